"""Tests for `ember.core.transforms.remat` (core/remat.py): gradients equal the plain function's
under every transform, the block really is recomputed, and only its inputs are saved."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ember.core import random
from ember.core.pytree import tree_leaves, tree_map
from ember.core.transforms import grad, remat, value_and_grad, vmap

WIDTH, HIDDEN, BATCH, DEPTH = 8, 16, 4, 3
TOL = dict(rtol=1e-6, atol=1e-6)  # fp32; remat recomputes the same ops, so only reordering differs


def block(p, x):
    """A 2-layer MLP block with a residual: x + W2 gelu(W1 x + b1) + b2."""
    return x + torch.nn.functional.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def make_params(seed=0, depth=DEPTH):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w1": torch.randn(WIDTH, HIDDEN, generator=g) / WIDTH**0.5,
            "b1": torch.randn(HIDDEN, generator=g) * 0.1,
            "w2": torch.randn(HIDDEN, WIDTH, generator=g) / HIDDEN**0.5,
            "b2": torch.randn(WIDTH, generator=g) * 0.1,
        }
        for _ in range(depth)
    ]


def make_x(seed=1):
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed))


def stack_loss(blk):
    def loss(params, x):
        for p in params:
            x = blk(p, x)
        return (x**2).mean()

    return loss


def assert_close(a, b):
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        torch.testing.assert_close(u, v, **TOL)


def test_grads_match_plain_function():
    params, x = make_params(), make_x()
    want = grad(stack_loss(block), argnums=(0, 1))(params, x)
    got = grad(stack_loss(remat(block)), argnums=(0, 1))(params, x)
    assert_close(got, want)


def test_nested_in_value_and_grad_with_aux():
    def with_aux(blk):
        def loss(params, x):
            for p in params:
                x = blk(p, x)
            return (x**2).mean(), {"x_mean": x.mean(), "h": x}

        return loss

    params, x = make_params(), make_x()
    (v0, aux0), g0 = value_and_grad(with_aux(block), argnums=(0, 1), has_aux=True)(params, x)
    (v1, aux1), g1 = value_and_grad(with_aux(remat(block)), argnums=(0, 1), has_aux=True)(params, x)
    assert_close((v1, aux1, g1), (v0, aux0, g0))


def test_ordinary_autograd_backward():
    def run(blk):
        params = tree_map(lambda t: t.clone().requires_grad_(), make_params())
        x = make_x().requires_grad_()
        stack_loss(blk)(params, x).backward()
        return [p.grad for p in tree_leaves(params)] + [x.grad]

    assert_close(run(remat(block)), run(block))


def test_recomputes_the_block_in_backward():
    calls = []

    def counted(p, x):
        calls.append(1)
        return block(p, x)

    grad(stack_loss(remat(counted)))(make_params(), make_x())
    assert len(calls) == 2 * DEPTH  # once forward, once in backward, per block
    calls.clear()
    grad(stack_loss(counted))(make_params(), make_x())
    assert len(calls) == DEPTH


def test_inside_torch_func_transforms_the_block_runs_plainly():
    # torch.func's engine would keep what a recomputing backward recomputes: remat steps aside there.
    calls = []

    def counted(p, x):
        calls.append(1)
        return block(p, x)

    params, x = make_params(), make_x()
    got = torch.func.grad(stack_loss(remat(counted)))(params, x)
    assert len(calls) == DEPTH  # forward only: nothing recomputed
    assert_close(got, grad(stack_loss(block))(params, x))


def _saved_bytes(blk):
    """Bytes autograd saves for backward (ordinary autograd, where saved-tensor hooks work)."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    params = tree_map(lambda t: t.clone().requires_grad_(), make_params())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stack_loss(blk)(params, make_x().requires_grad_())
    return sum(total)


def test_saves_only_block_inputs():
    per_block_inputs = 4 * (BATCH * WIDTH + 2 * WIDTH * HIDDEN + HIDDEN + WIDTH)
    loss_saves = 4 * BATCH * WIDTH  # x**2 keeps x
    assert _saved_bytes(remat(block)) == DEPTH * per_block_inputs + loss_saves
    assert _saved_bytes(block) > _saved_bytes(remat(block))


def test_static_args_kwargs_and_non_tensor_leaves():
    def configurable(p, x, act, cfg, *, scale):
        return x + act(x @ p["w1"] * cfg["gain"]) @ p["w2"] * scale

    cfg = {"gain": 0.5, "name": "mlp"}  # non-tensor leaves, flattened with the dynamic args

    def loss(blk):
        def f(params, x):
            for p in params:
                x = blk(p, x, torch.tanh, cfg, scale=torch.tensor(0.7))
            return x.square().sum()

        return f

    params, x = make_params(), make_x()
    want = grad(loss(configurable), argnums=(0, 1))(params, x)
    got = grad(loss(remat(configurable, static_argnums=2)), argnums=(0, 1))(params, x)
    assert_close(got, want)
    got_neg = grad(loss(remat(configurable, static_argnums=(-2,))), argnums=(0, 1))(params, x)
    assert_close(got_neg, want)


def test_integer_key_input_and_pytree_outputs(key):
    def dropped(p, x, k):
        y = random.dropout(k, block(p, x), 0.5)
        return {"y": y, "n_kept": (y != 0).sum(), "tag": "block"}

    def loss(blk):
        def f(params, x, k):
            out = blk(params[0], x, k)
            assert out["tag"] == "block" and out["n_kept"].dtype == torch.int64
            return (out["y"] ** 2).sum()

        return f

    params, x = make_params(), make_x()
    want = grad(loss(dropped), argnums=(0, 1))(params, x, key)
    got = grad(loss(remat(dropped)), argnums=(0, 1))(params, x, key)
    assert_close(got, want)  # the recomputation drew the same dropout mask from the key


def test_outputs_that_alias_inputs():
    def passthrough(p, x):
        return {"x": x, "head": x[:, :2], "y": block(p, x)}  # an input as-is, and a view of it

    def loss(blk):
        def f(params, x):
            out = blk(params[0], x)
            return out["x"].sum() + (out["head"] ** 2).sum() + out["y"].square().mean()

        return f

    params, x = make_params(), make_x()
    want = grad(loss(passthrough), argnums=(0, 1))(params, x)
    assert_close(grad(loss(remat(passthrough)), argnums=(0, 1))(params, x), want)
    xr = x.clone().requires_grad_()
    loss(remat(passthrough))(params, xr).backward()
    torch.testing.assert_close(xr.grad, want[1], **TOL)


def test_per_example_grads_under_vmap():
    params, xs = make_params(), make_x()

    def per_example(blk):
        loss = lambda params, x: stack_loss(blk)(params, x[None])  # noqa: E731
        return vmap(grad(loss), in_dims=(None, 0))(params, xs)

    assert_close(per_example(remat(block)), per_example(block))


def test_nested_remat_and_second_order():
    outer = remat(lambda p, x: remat(block)(p, remat(block)(p, x)))
    params, x = make_params(depth=1), make_x()
    want = grad(stack_loss(lambda p, x: block(p, block(p, x))), argnums=(0, 1))(params, x)
    assert_close(grad(stack_loss(outer), argnums=(0, 1))(params, x), want)

    # Hessian-vector product: differentiate the gradient through remat's backward.
    def hvp(blk):
        g = grad(lambda x: stack_loss(blk)(params, x))
        return grad(lambda x: (g(x) * torch.ones_like(x)).sum())(x)

    assert_close(hvp(remat(block)), hvp(block))


def test_grad_of_vmap_and_forward_mode():
    params, x = make_params(), make_x()

    def grad_of_vmap(blk):
        per_row = vmap(lambda x: stack_loss(blk)(params, x[None]))
        return grad(lambda params, x: per_row(x).sum(), argnums=(0, 1))(params, x)

    assert_close(grad_of_vmap(remat(block)), grad_of_vmap(block))
    jac = lambda blk: torch.func.jacfwd(lambda x: blk(params[0], x))(x)  # noqa: E731
    assert_close(jac(remat(block)), jac(block))
    hess = lambda blk: torch.func.hessian(lambda x: stack_loss(blk)(params, x))(x)  # noqa: E731
    assert_close(hess(remat(block)), hess(block))


@pytest.mark.parametrize(
    "static_argnums, exc, match",
    [
        ("2", TypeError, r"static_argnums must be an int or a tuple of ints, got '2'"),
        ((True,), TypeError, r"static_argnums must be an int or a tuple of ints"),
    ],
    ids=["str", "bool"],
)
def test_bad_static_argnums(static_argnums, exc, match):
    with pytest.raises(exc, match=match):
        remat(block, static_argnums=static_argnums)


def test_static_argnum_out_of_range():
    with pytest.raises(
        ValueError, match=r"index 5 has no matching positional argument; the call passed 2"
    ):
        remat(block, static_argnums=5)(make_params()[0], make_x())


_COMPILED_SCRIPT = textwrap.dedent(
    """
    import torch
    from ember.core.transforms import grad, remat, scan, stack_trees, value_and_grad

    def block(p, x):
        return x + torch.tanh(x @ p["w1"]) @ p["w2"]

    def loop_loss(layers, x):  # the reference: eager Python loop, no remat
        for p in layers:
            x = block(p, x)
        return (x ** 2).mean(), {"x_mean": x.mean()}

    def scan_loss(stacked, x):  # compiled: scan over stacked layers of a remat'd block
        x, _ = scan(lambda h, p: (remat(block)(p, h), None), x, stacked)
        return (x ** 2).mean(), {"x_mean": x.mean()}

    g = torch.Generator().manual_seed(0)
    layers = [{"w1": torch.randn(8, 16, generator=g) / 3, "w2": torch.randn(16, 8, generator=g) / 4}
              for _ in range(3)]
    x = torch.randn(4, 8, generator=g)
    (v0, aux0), (g0, gx0) = value_and_grad(loop_loss, argnums=(0, 1), has_aux=True)(layers, x)
    step = torch.compile(value_and_grad(scan_loss, argnums=(0, 1), has_aux=True), fullgraph=True)
    (v1, aux1), (g1, gx1) = step(stack_trees(layers), x)
    for a, b in [(v1, v0), (aux1["x_mean"], aux0["x_mean"]), (gx1, gx0)] + [
            (g1[k], torch.stack([p[k] for p in g0])) for k in ("w1", "w2")]:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    print("REMAT_COMPILED_OK")

    # A misuse error keeps its message under fullgraph (Dynamo reports it as the cause).
    try:
        torch.compile(grad(lambda w: w * 2), fullgraph=True)(torch.ones(4, 3))
    except Exception as e:
        assert "has shape (4, 3)" in str(e), str(e)
        print("ERROR_MESSAGE_OK")
    """
)


@pytest.mark.slow
def test_compiled_fullgraph_in_fresh_process():
    # value_and_grad(has_aux) of scan over a remat'd block, compiled with fullgraph, against the
    # eager Python loop. A failed compile of remat can leave Dynamo state behind, so this runs
    # in its own process.
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILED_SCRIPT], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "REMAT_COMPILED_OK" in proc.stdout and "ERROR_MESSAGE_OK" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_remat_lowers_peak_memory_under_value_and_grad():
    # Fresh processes, RSS high-water mark; see remat_memory.py. Activation-heavy shape (many
    # rows per weight): measured plain 161 MiB vs remat 40 MiB here, so 0.6 is a wide margin.
    script = Path(__file__).with_name("remat_memory.py")
    shape = ["--blocks", "8", "--width", "256", "--hidden", "1024", "--batch", "1024"]
    proc = subprocess.run(
        [sys.executable, str(script), *shape, "--json"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["custom"]
    plain, rematted = rows["plain"]["peak_mib"], rows["remat"]["peak_mib"]
    assert rematted < 0.6 * plain, rows
    assert rows["plain"]["loss"] == rows["remat"]["loss"]


@pytest.mark.slow
def test_remat_lowers_peak_memory_in_the_compiled_step():
    # The gradient taken inside the step compiled by ember.core.jit (make_fx + Inductor): the
    # recomputation is in the traced graph, so the forward's activations are freed early.
    # Measured plain 73 MiB, full 30 MiB, dots_saveable 47 MiB at this shape (torch 2.15 and 2.9).
    script = Path(__file__).with_name("remat_memory.py")
    shape = ["--blocks", "8", "--width", "256", "--hidden", "1024", "--batch", "1024"]
    proc = subprocess.run(
        [sys.executable, str(script), *shape, "--jit", "--json"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["custom"]
    plain, full, dots = (rows[v]["peak_mib"] for v in ("plain-jit", "remat-jit", "dots-jit"))
    assert full < 0.6 * plain and full < dots < plain, rows
    assert rows["plain-jit"]["loss"] == pytest.approx(rows["remat-jit"]["loss"], rel=1e-6)
