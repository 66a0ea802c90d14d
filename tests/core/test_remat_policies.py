"""Remat policies (core/remat_policies.py, core/remat_barrier.py): same gradients, and the traced
step recomputes exactly what each policy leaves out.

The memory each saves in the compiled step is measured in `test_remat.py` (fresh processes) and,
at the 125M Llama, by `launch/bench_scale.py --remat-memory` (BENCHMARKS.md).
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from ember.core.remat import remat
from ember.core.remat_policies import NO_REMAT, POLICY_NAMES, Record, checkpoint_name, remat_policy, save_names
from ember.core.testing import assert_trees_all_close
from ember.core.transforms import grad, value_and_grad, vmap
from ember.models import Llama3Config

POLICIES = ["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "save:hidden", "everything_saveable"]


def block(p, x):
    h = checkpoint_name(F.gelu(x @ p["w1"]), "hidden")  # (B, T, H)
    a = F.scaled_dot_product_attention(h, h, h, is_causal=True)  # a batched dot product
    return x + torch.tanh(a @ p["w2"])


def _case():
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(8, 16, generator=g), "w2": torch.randn(16, 8, generator=g)}, torch.randn(2, 4, 8, generator=g)


def _loss(policy):
    def loss(p, x):
        y = remat(block, policy=policy)(p, x)
        return remat(block, policy=policy)(p, y).square().mean()

    return loss


def _traced_ops(policy):
    """aten op counts of the traced gradient, after dead code is removed (what Inductor receives)."""
    from ember.core.jit_backends.trace import trace_and_compile

    p, x = _case()
    gm = trace_and_compile(lambda p1, p2, x: value_and_grad(_loss(policy))({"w1": p1, "w2": p2}, x),
                          [p["w1"], p["w2"], x])
    gm.graph.eliminate_dead_code()
    return Counter(
        str(n.target).split(".")[1] for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target).startswith(("aten.", "ember."))
    )


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap of CPU flash attention
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_plain_gradient(policy):
    p, x = _case()
    want = grad(_loss("none"))(p, x)
    assert_trees_all_close(grad(_loss(policy))(p, x), want, rtol=0, atol=0)
    per_example = vmap(grad(_loss(policy)), in_dims=(None, 0))(p, x[:, None])
    assert_trees_all_close(per_example, vmap(grad(_loss("none")), in_dims=(None, 0))(p, x[:, None]),
                           rtol=1e-6, atol=1e-6)


def test_traced_step_recomputes_what_each_policy_leaves_out():
    ops = {policy: _traced_ops(policy) for policy in POLICIES}
    attn = "_scaled_dot_product_flash_attention_for_cpu"
    none = ops["none"]
    # full: every op of both blocks runs again in the backward, behind the barrier.
    assert ops["full"]["mm"] == none["mm"] + 2 * 2 and ops["full"][attn] == 2 * none[attn]
    assert ops["full"]["gelu"] == 2 * none["gelu"] and ops["full"]["remat_barrier"] == 2
    # dots_saveable: no matrix product runs twice; the elementwise work does.
    assert ops["dots_saveable"]["mm"] == none["mm"] and ops["dots_saveable"][attn] == none[attn]
    assert ops["dots_saveable"]["gelu"] == 2 * none["gelu"]
    # without batch dims: weight matmuls kept, attention recomputed.
    assert ops["dots_with_no_batch_dims_saveable"]["mm"] == none["mm"]
    assert ops["dots_with_no_batch_dims_saveable"][attn] == 2 * none[attn]
    # save:hidden keeps gelu's output: gelu never runs twice (its input, x @ w1, does, for gelu's backward).
    assert ops["save:hidden"]["gelu"] == none["gelu"] and ops["save:hidden"][attn] == 2 * none[attn]
    # everything_saveable: nothing runs twice.
    assert all(ops["everything_saveable"][op] == none[op] for op in ("mm", attn, "gelu"))


def test_everything_saveable_leaves_out_what_costs_nothing_to_recompute():
    p, x = _case()
    with Record(remat_policy("everything_saveable")) as record:
        h = x @ p["w1"]  # (B, T, H): mm, then a reshape (_unsafe_view, whose schema does not alias)
        scale = (h * h).mean()  # 0-d
        torch.tanh(h) * scale
    kept = {func.overloadpacket.__name__ for func, _ in record.saved}
    assert {"mm", "mul", "tanh"} <= kept
    assert not kept & {"_unsafe_view", "mean"}, kept


def test_a_traced_rolled_layer_keeps_only_what_its_backward_reads():
    p, x = _case()
    x = x.requires_grad_()
    with torch.enable_grad(), Record(remat_policy("everything_saveable"), only_what_autograd_saves=True) as record:
        h = x @ p["w1"]  # mm, then a free reshape: sin's backward reads it, so the mm result is kept
        s = torch.sin(h) + 1.0  # the add's result feeds only an exp, which saves its own output
        (torch.exp(s) * 2.0).sum()
    kept = Counter(func.overloadpacket.__name__ for func, _ in record.saved)
    assert kept == Counter({"mm": 1, "exp": 1}), kept
    with torch.no_grad(), Record(remat_policy("everything_saveable"), only_what_autograd_saves=True) as plain:
        torch.exp(torch.sin(x @ p["w1"]) + 1.0)  # no autograd graph to ask: every result, as before
    assert {"mm", "sin", "add", "exp"} <= {func.overloadpacket.__name__ for func, _ in plain.saved}


def test_a_rolled_layer_without_remat_rebuilds_its_elementwise_results():
    p, x = _case()
    x = x.requires_grad_()
    with torch.enable_grad(), Record(NO_REMAT, only_what_autograd_saves=True) as record:
        h = F.silu(x @ p["w1"]) * (x @ p["w1"]).cos()  # SwiGLU-shaped: autograd saves the silu, cos, products
        a = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        (a.exp() * h.mean(-1, keepdim=True)).sum()
    kept = Counter(func.overloadpacket.__name__ for func, _ in record.saved)
    # the matmuls, the attention (a fused kernel, or bmm and softmax on torch before 2.15) and the reduction: what
    # torch.compile's partitioner keeps; not one elementwise result
    assert {"mm", "mean"} <= set(kept) and not set(kept) & {"silu", "cos", "mul", "exp", "add"}, kept
    assert kept["mm"] == 2


def test_checkpoint_name_outside_remat_is_identity():
    x = torch.ones(3)
    assert checkpoint_name(x, "anything") is x


def test_policy_names_and_bool_configs():
    assert remat_policy("none") is None and remat_policy(False) is None
    assert remat_policy(True) == remat_policy("full")
    assert remat_policy("save: qkv, mlp_hidden") == save_names("qkv", "mlp_hidden")
    assert remat(block, policy="none") is block
    assert POLICY_NAMES[:2] == ("none", "full")


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ("dot_saveable", ValueError, r"unknown remat policy 'dot_saveable'; did you mean 'dots_saveable'"),
        ("fulll", ValueError, r"did you mean 'full'"),
        ("save:", ValueError, r"save_names\(\.\.\.\) takes one or more"),
        (3, TypeError, r"a remat policy is a name such as 'full'"),
    ],
)
def test_bad_policies_name_the_fix(bad, exc, match):
    with pytest.raises(exc, match=match):
        remat(block, policy=bad)


def test_config_checks_the_policy_and_reads_old_bools():
    with pytest.raises(ValueError, match=r"Llama3Config.remat: unknown remat policy 'dots'; did you mean 'dots_saveable' or 'dots_with_no_batch_dims_saveable'"):
        Llama3Config(remat="dots")
    assert Llama3Config(remat=True).remat == "full" and Llama3Config(remat=False).remat == "none"
