"""`scan` rolled inside ember's Inductor trace (core/scan_rolled.py): one `scan` node each way, whatever
the length, with the Python loop's values and gradients; where it cannot roll, the Python loop."""

from __future__ import annotations

import pytest
import torch

from ember.core import jit
from ember.core.jit_backends.trace import trace_and_compile
from ember.core.transforms import grad, rolled_sum, scan, value_and_grad

# compiled float32 against eager: the steps' contributions to a gradient summed in Inductor's order and autograd's
# (measured: 1.5e-6 absolute on a gradient element of 0.05, torch 2.15; 1.1e-6 on one of 0.008, torch 2.9)
TOL = dict(rtol=1e-4, atol=1e-5)


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


def test_a_body_closing_over_differentiated_tensors_rolls_with_their_gradients_summed():
    """A tensor the body closes over enters the loop as an input, its gradient summed over the steps, as
    JAX's scan does with a closed-over value: a parameter beside `xs`, and the loop's own first carry."""
    def loss(xs, h0, shift):
        h, _ = scan(lambda h, x: (_layer(h, {"w": x["w"], "b": x["b"] + shift}) + 0.1 * h0, None), h0, xs)
        return h.pow(2).sum()

    xs, h0, shift = _stack(4), torch.randn(4, 8), torch.randn(8)
    step = grad(loss, argnums=(0, 1, 2))
    assert _loops(step, xs, h0, shift) == 2
    torch.testing.assert_close(jit(step)(xs, h0, shift), step(xs, h0, shift), **TOL)


def test_differentiated_scans_of_two_lengths_compile_in_one_process():
    """torch's `scan` compiles every body on one code object: a second length would make Dynamo's sizes
    symbols, lifted as numbers Inductor's loop lowering cannot read (pytorch/pytorch#166525); ember traces
    them static, and both gradients are right."""
    for length in (6, 24):
        xs, h0 = _stack(length), torch.randn(4, 8)
        step = grad(_loss, argnums=(0, 1))
        torch.testing.assert_close(jit(step)(xs, h0), step(xs, h0), **TOL)


def test_gradients_that_pass_through_the_loop_unchanged():
    """The backward loop's inputs and outputs may not alias: cotangents that are views of one tensor (the
    expanded ones of summed 0-d statistics) and an `x` whose cotangent is its `y`'s, as it came."""
    def loss(xs, h0):
        def step(carry, x):
            h, stats = carry
            new = _layer(h, x)
            return (new, {"sum": stats["sum"] + new.sum(), "sq": stats["sq"] + new.pow(2).sum()}), x["b"]
        zero = torch.zeros(())
        (h, stats), ys = scan(step, (h0, {"sum": zero, "sq": zero}), xs)
        return h.mean() + sum(v.sum() for v in stats.values()) + ys.pow(2).sum()

    xs, h0 = _stack(6), torch.randn(4, 8)
    step = value_and_grad(loss, argnums=(0, 1))
    torch.testing.assert_close(jit(step)(xs, h0), step(xs, h0), **TOL)


def test_rolled_sum_is_one_scan_node_at_any_length_with_the_python_loops_sum():
    def contribution(w, x):  # a microbatch's loss and gradients, as train_step sums them
        loss, g = value_and_grad(lambda w: torch.tanh(x @ w).pow(2).sum())(w)
        return {"g": g, "loss": loss, "n": torch.ones((), dtype=torch.int64), "none": None}

    w = torch.randn(3, 2)
    for length in (3, 9):
        xs = torch.randn(length, 4, 3)
        want = rolled_sum(contribution, w, xs)  # outside ember's trace: the first slice's, then the rest's
        assert _loops_in(trace_and_compile(lambda w, xs: rolled_sum(contribution, w, xs)["g"], (w, xs))) == 1
        got = jit(lambda w, xs: rolled_sum(contribution, w, xs))(w, xs)
        torch.testing.assert_close(got["g"], want["g"], **TOL)
        torch.testing.assert_close(got["loss"], want["loss"], **TOL)
        assert int(got["n"]) == length and got["none"] is None
        torch.testing.assert_close(want["g"], sum(grad(lambda w: torch.tanh(x @ w).pow(2).sum())(w) for x in xs), **TOL)


def test_train_steps_microbatches_are_one_scan_node_whatever_their_number():
    from ember import optim
    from ember.core import TrainState, random
    from ember.core.step_fns import train_step

    def loss_fn(params, batch, *, key):
        return ((batch["x"] @ params["w"] - batch["y"]) ** 2).mean()

    batch = {"x": torch.randn(8, 3), "y": torch.randn(8, 2)}
    state = TrainState.create(params={"w": torch.randn(3, 2)}, tx=optim.sgd(0.1), key=random.key(0))
    for k in (2, 8):
        step = train_step(loss_fn, microbatches=k)
        traced = trace_and_compile(lambda w, x, y: step(state.replace(params={"w": w}), {"x": x, "y": y})[1]["loss"],
                                   (state.params["w"], batch["x"], batch["y"]))
        assert _loops_in(traced) == 1
        want_state, want = step(state, batch)
        got_state, got = jit(step)(state, batch)
        torch.testing.assert_close(got["loss"], want["loss"], **TOL)
        torch.testing.assert_close(got_state.params["w"], want_state.params["w"], **TOL)


def test_a_body_with_a_python_side_effect_rolls_its_python_running_when_traced():
    """As in `jax.lax.scan`: the body is traced, not run per step; the compiled step does not run it again."""
    calls = []

    def step(h, x):
        calls.append(1)
        return _layer(h, x), None

    xs, h0 = _stack(8), torch.randn(2, 8)
    want = scan(step, h0, xs)[0]
    assert len(calls) == 8
    fn = jit(lambda xs, h: scan(step, h, xs)[0])
    got = fn(xs, h0)
    traced = len(calls) - 8
    assert 0 < traced < 8, traced  # a dry run of one step and the body's trace
    torch.testing.assert_close(fn(xs, h0), want, **TOL)
    torch.testing.assert_close(got, want, **TOL)
    assert len(calls) == 8 + traced
    assert _loops(lambda xs, h: scan(step, h, xs)[0], xs, h0) == 1


def test_a_body_closing_over_tensors_of_the_step_rolls_with_them_as_loop_inputs():
    """Tensors the body reads but neither gets as arguments nor makes enter the loop as its inputs."""
    def loss(xs, h0, shift):
        h, ys = scan(lambda h, x: (_layer(h, {"w": x["w"], "b": x["b"] + shift}) * shift.mean().sigmoid(), h.mean()), h0, xs)
        return h.pow(2).sum() + ys.sum()

    xs, h0, shift = _stack(5), torch.randn(4, 8), torch.randn(8)
    assert _loops(loss, xs, h0, shift) == 1
    step = grad(loss, argnums=(0, 1))
    assert _loops(step, xs, h0, shift) == 2
    torch.testing.assert_close(jit(loss)(xs, h0, shift), loss(xs, h0, shift), **TOL)
    torch.testing.assert_close(jit(step)(xs, h0, shift), step(xs, h0, shift), **TOL)


def test_consts_that_need_gradients_roll_as_explicit_inputs_with_summed_gradients():
    from ember.core.scan_rolled import rolled_scan

    def layer(h, x, consts):
        return torch.tanh(h @ x["w"] + x["b"]) * consts["scale"] + h, None

    def loss(xs, h0, scale, rolled):
        consts = {"scale": scale, "flag": True}
        if rolled:
            out = rolled_scan(layer, h0, xs, len(xs["w"]), False, consts)
            assert out is not None  # a closure over `scale` would not roll: as an explicit input it does
            return out[0].pow(2).sum()
        return scan(lambda h, x: layer(h, x, consts), h0, xs)[0].pow(2).sum()

    xs, h0, scale = _stack(5), torch.randn(3, 8), torch.tensor(0.7)
    want = value_and_grad(lambda *a: loss(*a, rolled=False), argnums=(0, 1, 2))(xs, h0, scale)
    traced = trace_and_compile(lambda w, b, h, s: value_and_grad(lambda *a: loss(*a, rolled=True), argnums=(0, 1, 2))(
        {"w": w, "b": b}, h, s)[1][2], (xs["w"], xs["b"], h0, scale))
    assert _loops_in(traced) == 2
    got = jit(value_and_grad(lambda *a: loss(*a, rolled=True), argnums=(0, 1, 2)))(xs, h0, scale)
    torch.testing.assert_close(got, want, **TOL)


def test_a_loop_drops_the_inputs_its_body_never_reads_and_the_graph_that_made_them():
    """Per-layer keys a stack that draws nothing never reads, as JAX's scan drops dead inputs: neither loop takes
    them, and the step's graph no longer computes them."""
    from ember.core import random

    xs, h0 = _stack(6), torch.randn(4, 8)

    def loss(xs, h0, key):
        keyed = {**xs, "key": random.split(key, 6)}
        h, _ = scan(lambda h, x: (_layer(h, x), None), h0, keyed)
        return h.pow(2).sum()

    step = value_and_grad(loss, argnums=(0, 1))
    gm = trace_and_compile(lambda w, b, h, k: step({"w": w, "b": b}, h, k), (xs["w"], xs["b"], h0, random.key(0)))
    loops = [node for node in gm.graph.nodes if node.op == "call_function" and str(node.target) == "scan"]
    assert len(loops) == 2
    forward, backward = loops
    assert len(forward.args[2]) == 2  # w and b sliced; the keys gone
    # the backward walks an int64 index back over its stacked inputs (saved carries, w, b): no key among them
    ints = lambda args: sum(a.meta["val"].dtype == torch.int64 for a in args)  # noqa: E731
    assert ints(forward.args[3]) == ints(backward.args[3]) == 0 and ints(backward.args[2]) == 1
    assert not any(str(node.target).startswith("aten.bitwise_xor") for node in gm.graph.nodes)
    torch.testing.assert_close(jit(step)(xs, h0, random.key(0)), step(xs, h0, random.key(0)), **TOL)


def test_a_loop_computes_what_its_constants_alone_determine_once_before_it():
    """A table each step makes from `arange` and the loop's constants (a rotary table) is made once, before each
    loop, as XLA hoists a while loop's invariants; what a step computes from its carry and slice stays in it."""
    xs, h0 = _stack(5), torch.randn(4, 8)
    scale = torch.tensor(0.5)

    def loss(xs, h0, scale):
        def layer(h, x):
            table = (torch.arange(8.0) * scale).cos()  # the same every step
            return _layer(h * table, x), None

        return scan(layer, h0, xs)[0].pow(2).sum()

    step = value_and_grad(loss, argnums=(0, 1))
    gm = trace_and_compile(lambda w, b, h, s: step({"w": w, "b": b}, h, s), (xs["w"], xs["b"], h0, scale))
    loops = [node for node in gm.graph.nodes if node.op == "call_function" and str(node.target) == "scan"]
    assert len(loops) == 2
    ops = lambda g: {str(n.target) for n in g.nodes if n.op == "call_function"}  # noqa: E731
    bodies = [ops(getattr(gm, loop.args[0].target).graph) for loop in loops]
    assert not any("aten.cos.default" in body for body in bodies), "made in every step"
    assert "aten.tanh.default" in bodies[0] and "aten.cos.default" in ops(gm.graph)
    torch.testing.assert_close(jit(step)(xs, h0, scale), step(xs, h0, scale), **TOL)


def test_a_literal_in_a_loop_is_made_by_a_factory_not_lifted():
    """A 0-d literal a step makes (`torch.tensor(2.0)`) is a `full` in the body, not a lifted constant: before
    torch 2.15 AOTAutograd's functionalization refuses a body's lifted constant (the DTensor chunked loss)."""
    xs, h0 = _stack(3), torch.randn(4, 8)

    def loss(xs, h0):
        def layer(h, x):
            return _layer(h, x) * torch.tensor(2.0), None

        return scan(layer, h0, xs)[0].pow(2).sum()

    step = value_and_grad(loss, argnums=(0, 1))
    gm = trace_and_compile(lambda w, b, h: step({"w": w, "b": b}, h), (xs["w"], xs["b"], h0))
    bodies = [getattr(gm, n.args[0].target).graph for n in gm.graph.nodes
              if n.op == "call_function" and str(n.target) == "scan"]
    targets = [str(n.target) for body in bodies for n in body.nodes]
    assert bodies and "aten.lift_fresh_copy.default" not in targets and "aten.full.default" in targets
    torch.testing.assert_close(jit(step)(xs, h0), step(xs, h0), **TOL)
