"""`remat_scan`: one node of the compiled step each way, a body traced once, the plain results. Stacked layers roll as torch's `scan` (nodes of the step's graph), whatever the policy: the forward
stacks what the policy keeps, the backward hands it back."""

import pytest
import torch
from _graphs import scan_nodes, scan_outputs, traced

from ember.core import jit
from ember.core.transforms import grad, remat, remat_scan, scan, value_and_grad, vmap


def _layer(h, x, consts):
    w, key = x
    scale, flag = consts["scale"], consts["flag"]
    out = torch.tanh(h @ w["w"] + w["b"]) * scale + h
    noise = (key.to(h.dtype).sum() * 1e-3) if flag else 0.0  # an integer per-layer input
    return out + noise


def _stack(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(length, 4, 4, generator=g) / 2, "b": torch.randn(length, 4, generator=g)}
    keys = torch.arange(2 * length, dtype=torch.int64).reshape(length, 2)
    return params, keys


def _loss_rolled(params, h, scale, keys, policy="full"):
    h = remat_scan(_layer, h, (params, keys), {"scale": scale, "flag": True}, policy=policy)
    return (h ** 2).sum()


def _loss_plain(params, h, scale, keys):
    h = scan(lambda c, x: (_layer(c, x, {"scale": scale, "flag": True}), None), h, (params, keys))[0]
    return (h ** 2).sum()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("policy", ["full", "dots_saveable", "none"])
def test_remat_scan_gives_the_plain_gradients(compiled, policy):
    params, keys = _stack(5)
    h, scale = torch.randn(3, 4), torch.tensor(0.7)
    want = value_and_grad(_loss_plain, argnums=(0, 1, 2))(params, h, scale, keys)
    fn = lambda p, h, s, k: value_and_grad(_loss_rolled, argnums=(0, 1, 2))(p, h, s, k, policy)  # noqa: E731
    got = jit(fn)(params, h, scale, keys) if compiled else fn(params, h, scale, keys)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if compiled:  # the forward loop hands the backward each layer's input and what the policy kept
        forward, _ = scan_outputs(fn, params, h, scale, keys)
        # the last carry, then the layer inputs and kept results stacked; none keeps what a plain layer's
        # autograd graph holds: the tanh result (its backward reads it); the matmul's inputs are the layer's
        # own, and the adds and products need nothing more
        assert forward - 2 == {"full": 0, "dots_saveable": 1, "none": 1}[policy]


def test_remat_scan_traces_the_layer_the_same_number_of_times_at_any_depth():
    traced = []

    def layer(h, w, _):
        traced.append(1)
        return torch.tanh(h @ w)

    counts = []
    for length in (2, 8):
        ws = torch.randn(length, 4, 4) / 2
        traced.clear()
        jit(grad(lambda ws, h: remat_scan(layer, h, ws, policy="dots_saveable").sum()))(ws, torch.randn(3, 4))
        counts.append(len(traced))
    assert counts[0] == counts[1] and counts[0] <= 4  # forward body, the vjp body, and their traces


def test_remat_scan_full_is_two_scan_nodes_at_any_depth():
    layer = lambda h, w, _: torch.tanh(h @ w)  # noqa: E731
    step = grad(lambda ws, h: remat_scan(layer, h, ws).sum())
    for length in (2, 8):
        ws, h = torch.randn(length, 4, 4) / 2, torch.randn(3, 4)
        assert scan_nodes(step, ws, h) == 2  # the forward, the backward
        torch.testing.assert_close(jit(step)(ws, h), grad(lambda ws: scan(
            lambda c, w: (layer(c, w, None), None), h, ws)[0].sum())(ws), rtol=1e-5, atol=1e-5)


def test_remat_scan_computes_only_the_gradients_asked_for():
    params, keys = _stack(3)
    h = torch.randn(2, 4)
    frozen = lambda h: _loss_rolled(params, h, torch.tensor(1.0), keys, "dots_saveable")  # noqa: E731  params are constants
    plain = lambda h: _loss_plain(params, h, torch.tensor(1.0), keys)  # noqa: E731
    torch.testing.assert_close(jit(grad(frozen))(h), grad(plain)(h), rtol=1e-5, atol=1e-5)
    _, backward = scan_outputs(grad(frozen), h)
    assert backward == 1 + 1  # the carry's gradient only (and the 0-d y of a loop without ys)


def test_remat_scan_under_vmap_and_grad_of_grad_runs_plainly():
    params, keys = _stack(3)
    hs = torch.randn(2, 3, 4)
    per_example = vmap(lambda h: _loss_rolled(params, h, torch.tensor(1.0), keys))(hs)
    torch.testing.assert_close(per_example, torch.stack([_loss_plain(params, h, torch.tensor(1.0), keys) for h in hs]))
    second = grad(lambda s: grad(lambda h: _loss_rolled(params, h, s, keys))(hs[0]).sum())(torch.tensor(1.0))
    want = grad(lambda s: grad(lambda h: _loss_plain(params, h, s, keys))(hs[0]).sum())(torch.tensor(1.0))
    torch.testing.assert_close(second, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy, length", [("full", 5), ("dots_saveable", 5), ("none", 5), ("none", 1)])
def test_remat_scan_rolls_a_tree_carry(policy, length):
    # Activations with statistics riding along (a mixture of experts' router losses), an integer
    # counter among them: one loop each way, the plain scan's values and gradients.
    def layer(carry, x, _):
        h, stats = carry
        w, _key = x
        new = torch.tanh(h @ w["w"] + w["b"]) + h
        sq = new.pow(2).mean()
        return new, {"sq": stats["sq"] + sq, "sq_again": stats["sq_again"] + sq, "calls": stats["calls"] + 1,
                     "passed": stats["passed"].view(-1).view(())}  # returned as it came, through a view

    def loss(params, h, scan_fn):
        zero = torch.zeros(())  # one object twice: the compiled layer returns one tensor for both sums
        stats = {"sq": zero, "sq_again": zero, "calls": torch.zeros((), dtype=torch.int64), "passed": torch.ones(())}
        h, stats = scan_fn(layer, (h, stats), params)
        return h.pow(2).sum() + stats["sq"] + stats["sq_again"], stats["calls"]

    rolled = lambda fn, carry, params: remat_scan(fn, carry, (params, keys), policy=policy, name="test.tree")  # noqa: E731
    plain = lambda fn, carry, params: scan(lambda c, x: (fn(c, x, None), None), carry, (params, keys))[0]  # noqa: E731
    params, keys = _stack(length)
    h = torch.randn(3, 4)
    step = value_and_grad(lambda p, h: loss(p, h, rolled), argnums=(0, 1), has_aux=True)
    (value, calls), grads = jit(step)(params, h)
    if length > 1:
        assert scan_nodes(step, params, h) == 2
    (want_value, want_calls), want = value_and_grad(lambda p, h: loss(p, h, plain), argnums=(0, 1), has_aux=True)(params, h)
    assert int(calls) == int(want_calls) == length
    torch.testing.assert_close(value, want_value, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads, want, rtol=1e-5, atol=1e-5)
    eager = value_and_grad(lambda p, h: loss(p, h, rolled), argnums=(0, 1), has_aux=True)(params, h)
    torch.testing.assert_close(eager[1], want, rtol=1e-5, atol=1e-5)


def test_a_kept_result_comes_back_laid_out_as_the_forward_made_it():
    # exp of a transposed tensor is transposed in memory, so reshaping it transposed back is a view. Handed back
    # contiguous (as the scan stacks it), that reshape would copy, a `clone` the forward did not run, and the
    # clone kept after it would be handed to that copy (measured on SDPA's output in a mixture-of-experts
    # layer: a shape error; here wrong gradients).
    def layer(h, w, _):
        z = torch.exp(torch.tanh(h @ w).t())
        a = (z.t().reshape(-1).reshape(h.shape) @ w).clone()  # `a * a` keeps the clone
        return torch.tanh(a * a)

    ws, h = torch.randn(3, 4, 4) / 2, torch.randn(2, 4)
    rolled = grad(lambda ws, h: remat_scan(layer, h, ws, policy="none").sum(), argnums=(0, 1))
    plain = grad(lambda ws, h: scan(lambda c, w: (layer(c, w, None), None), h, ws)[0].sum(), argnums=(0, 1))
    torch.testing.assert_close(jit(rolled)(ws, h), plain(ws, h), rtol=1e-5, atol=1e-5)


def test_the_backward_loop_reads_the_stacks_in_place_walking_back():
    # a reversed scan reads slice i of each stacked input where it lies; flipping them would copy the
    # weights and every kept activation (1.67x the unrolled step's peak memory at 125M)
    params, keys = _stack(5)
    fn = lambda p, h, s, k: grad(_loss_rolled)(p, h, s, k, "none")  # noqa: E731
    graph = traced(fn, params, torch.randn(3, 4), torch.tensor(0.7), keys).graph
    flips = [node for node in graph.nodes if node.op == "call_function" and "flip" in str(node.target)]
    assert len(flips) == 2  # the gradients of w and b, stacked walking back, put back in order


def test_a_layer_that_changes_the_carry_shape_is_a_clear_error():
    ws = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="carry must keep its shape and dtype"):
        jit(grad(lambda ws, h: remat_scan(lambda h, w, _: h @ w, h, ws).sum()))(ws, torch.randn(3, 4))


def test_remat_scan_matches_remat_per_layer_when_rolling_is_impossible():
    # remat of a remat_scan: the inner loop is below remat's own autograd.Function, so it runs plainly.
    params, keys = _stack(2)
    h = torch.randn(2, 4)
    outer = remat(lambda h: _loss_rolled(params, h, torch.tensor(1.0), keys))
    torch.testing.assert_close(jit(grad(outer))(h), grad(lambda h: _loss_plain(params, h, torch.tensor(1.0), keys))(h),
                               rtol=1e-5, atol=1e-5)


XLA_SCRIPT = """
import json, sys, torch
sys.path[:0] = [{here!r}, {tests!r}]
import importlib
rs = importlib.import_module("ember.core.remat_scan")
from ember.core import jit
from ember.core.device import device_for, to_device
from ember.core.transforms import value_and_grad
from test_remat_scan_loop import _loss_plain, _loss_rolled, _stack

loops = []
scan_on_xla = rs.xla_scan
rs.xla_scan = lambda *a: (loops.append(1), scan_on_xla(*a))[1]
params, keys = _stack(5)
h, scale = torch.randn(3, 4), torch.tensor(0.7)
want = value_and_grad(_loss_plain, argnums=(0, 1, 2))(params, h, scale, keys)
step = jit(lambda p, h, s, k: value_and_grad(_loss_rolled, argnums=(0, 1, 2))(p, h, s, k), backend="xla")
got = to_device(step(*to_device((params, h, scale, keys), device_for("xla"))), torch.device("cpu"))
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
print(json.dumps({{"whiles": len(loops), "compiles": step.compile_count}}))
"""


@pytest.mark.xla
def test_remat_scan_on_xla_is_one_while_each_way_with_the_plain_gradients():
    import json
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    here = pathlib.Path(__file__).parent
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    script = XLA_SCRIPT.format(here=str(here), tests=str(here.parent))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"whiles": 2, "compiles": 1}


KEPT_ON_XLA_SCRIPT = """
import json, torch
from torch_xla.experimental import scan as xla_scan_module
from ember.core import jit, random
from ember.core.device import device_for, to_device
from ember.core.transforms import value_and_grad
from ember.models import build_model

model = build_model("llama3", "tiny", n_layers=3, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64)
params = model.init(random.key(0))
tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
loss = lambda p, t: model.apply(p, t).float().pow(2).mean()  # noqa: E731
want = value_and_grad(loss)(params, tokens)
step = jit(value_and_grad(loss), backend="xla")
p, t = to_device((params, tokens), device_for("xla"))
for _ in range(3):
    got = to_device(step(p, t), torch.device("cpu"))
torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
traces = sum(len(by_shape) for by_shape in xla_scan_module._SCAN_COMPUTATION_CACHE.values())
print(json.dumps({"compiles": step.compile_count, "traces": traces}))
"""


@pytest.mark.xla
def test_remat_none_on_xla_is_torch_xlas_differentiable_scan_traced_once_across_steps():
    """Policy "none" (the default) keeps what a plain layer's autograd keeps: torch_xla's own scan, whose
    AOTAutograd backward does so, traced once for the layer however many steps run (the body is kept)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, "-c", KEPT_ON_XLA_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"compiles": 1, "traces": 1}
