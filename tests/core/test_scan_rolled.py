"""`scan` rolled inside ember's Inductor trace (core/scan_rolled.py): one `scan` node each way, whatever
the length, with the Python loop's values and gradients; where it cannot roll, the Python loop."""

from __future__ import annotations

import pytest
import torch

from ember.core import jit
from ember.core.compat import measured_here
from ember.core.jit_backends.trace import trace_and_compile
from ember.core.transforms import grad, scan, value_and_grad

TOL = dict(rtol=1e-5, atol=1e-6)


def _layer(h, x):
    return torch.tanh(h @ x["w"] + x["b"])


def _stack(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(length, 8, 8, generator=g) * 0.3, "b": torch.randn(length, 8, generator=g) * 0.1}


def _loss(xs, h0, reverse=False, unroll=1):
    """A carry of two leaves (one integer), a pytree of ys with a None leaf."""
    def step(carry, x):
        h, count = carry
        new = _layer(h, x)
        return (new, count + 1), {"mean": new.mean(-1), "none": None}

    (h, count), ys = scan(step, (h0, torch.zeros((), dtype=torch.int64)), xs, reverse=reverse, unroll=unroll)
    return h.pow(2).sum() + ys["mean"].pow(2).sum() * (count == len(xs["w"]))


def _traced(fn, xs, *rest):
    """`fn(xs, *rest)` traced as ember's Inductor step traces it (flat tensor inputs), not compiled."""
    return trace_and_compile(lambda w, b, *r: fn({"w": w, "b": b}, *r), (xs["w"], xs["b"], *rest))


def _loops_in(gm):
    return sum(node.op == "call_function" and str(node.target) == "scan" for node in gm.graph.nodes)


def _loops(fn, xs, *rest):
    return _loops_in(_traced(fn, xs, *rest))


@pytest.mark.parametrize("reverse", [False, True])
def test_rolled_scan_gives_the_python_loops_values_and_gradients(reverse):
    xs, h0 = _stack(6), torch.randn(4, 8)
    step = value_and_grad(lambda xs, h0: _loss(xs, h0, reverse), argnums=(0, 1))
    want = step(xs, h0)
    compiled = jit(step)
    got = compiled(xs, h0)
    torch.testing.assert_close(got, want, **TOL)
    again = compiled(xs, h0)  # the same bits the second time
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(got),
                                                   torch.utils._pytree.tree_leaves(again)))


def test_the_trace_holds_one_loop_each_way_whatever_the_length():
    step = grad(_loss, argnums=(0, 1))
    sizes = []
    for length in (3, 12):
        xs, h0 = _stack(length), torch.randn(4, 8)
        gm = _traced(step, xs, h0)
        assert _loops_in(gm) == 2  # forward, backward
        sizes.append(len(gm.graph.nodes))
    assert sizes[0] == sizes[1]


def test_forward_only_scan_rolls_without_saving():
    xs, h0 = _stack(5), torch.randn(4, 8)
    assert _loops(_loss, xs, h0) == 1
    torch.testing.assert_close(jit(_loss)(xs, h0), _loss(xs, h0), **TOL)


def test_unroll_of_the_length_unrolls():
    xs, h0 = _stack(4), torch.randn(4, 8)
    assert _loops(lambda xs, h0: _loss(xs, h0, unroll=True), xs, h0) == 0
    assert _loops(lambda xs, h0: _loss(xs, h0, unroll=4), xs, h0) == 0
    assert _loops(lambda xs, h0: _loss(xs, h0, unroll=2), xs, h0) == 1


def test_a_body_closing_over_a_differentiated_tensor_runs_the_python_loop():
    """Its gradient would have no way out of the loop: the steps unroll, and the gradient is whole."""
    def loss(xs, h0, shift):
        h, _ = scan(lambda h, x: (_layer(h, {"w": x["w"], "b": x["b"] + shift}), None), h0, xs)
        return h.pow(2).sum()

    xs, h0, shift = _stack(4), torch.randn(4, 8), torch.randn(8)
    step = grad(loss, argnums=(0, 2))
    assert _loops(step, xs, h0, shift) == 0
    assert _loops(loss, xs, h0, shift) == 1  # no gradient taken: it rolls
    torch.testing.assert_close(jit(step)(xs, h0, shift), step(xs, h0, shift), **TOL)


def test_scan_numbers_patch_is_needed(monkeypatch):
    """Without `compat/scan.py`'s inlining, Inductor fails on a differentiated rolled scan
    (pytorch/pytorch#166525) on the releases where that was measured; with it the gradients are right."""
    def compile_both():
        for length in (6, 24):
            xs, h0 = _stack(length), torch.randn(4, 8)
            step = grad(_loss, argnums=(0, 1))
            torch.testing.assert_close(jit(step)(xs, h0), step(xs, h0), **TOL)

    compile_both()
    if not measured_here("scan_numbers"):
        return
    monkeypatch.setenv("EMBER_DISABLE_PATCHES", "scan_numbers")
    with pytest.raises(Exception, match="meta|FakeTensorUpdater"):
        compile_both()
