"""`trace_context.here()`: the one query for how a call runs, the same answer wherever it is asked."""

import torch

from ember.core import jit
from ember.core.trace_context import (held_through_backward, here, inside_gradient, loop_body, using_sharding,
                                      xla_loop_body)
from ember.core.transforms import grad, shared_call, vmap


def test_eagerly_nothing_traces_and_nothing_is_shared():
    now = here()
    assert (now.tracer, now.transform, now.shares, now.in_xla_loop, now.sharding, now.gradients) == (
        None, False, False, False, None, 0)
    assert not now.ember_traced and not now.torch_func


def test_ember_trace_shares_outside_a_loop_body_only():
    seen = []

    def f(x):
        seen.append(here())
        with loop_body():
            seen.append(here())
        return shared_call(lambda t: (seen.append(here()), t * 2)[1], "test.trace_context", x)

    torch.testing.assert_close(jit(f)(torch.ones(2)), torch.full((2,), 2.0))
    outer, body, shared = seen
    assert outer.tracer == "ember" and outer.ember_traced and outer.shares
    assert body.tracer == "ember" and not body.shares  # another shared subgraph would nest
    assert shared.tracer == "ember" and not shared.shares  # inside the shared body


def test_a_torch_func_transform_and_dynamo_take_the_gradients():
    seen = []
    vmap(lambda x: (seen.append(here()), x)[1])(torch.ones(2, 3))
    assert seen[-1].transform and seen[-1].torch_func and not seen[-1].shares
    torch.compile(lambda x: (seen.append(here()), x + 1)[1], backend="eager", fullgraph=True)(torch.ones(2))
    assert seen[-1].tracer == "dynamo" and seen[-1].torch_func


def test_gradients_nest_and_held_contexts_exit_after_the_backward():
    seen, events = [], []

    class Noted:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    def loss(w):
        seen.append(here().gradients)
        with held_through_backward(Noted()):
            events.append("inside")
        return (w ** 3).sum()

    second = grad(lambda w: grad(loss)(w).sum())(torch.ones(2))
    torch.testing.assert_close(second, torch.full((2,), 6.0))
    assert seen == [2] and here().gradients == 0
    assert events == ["enter", "inside", "exit"]  # exited by the inner gradient, after its backward
    with inside_gradient():
        assert here().gradients == 1
    assert here().gradients == 0


def test_sharding_and_xla_loop_bodies_are_scoped():
    marker = object()
    with using_sharding(marker):
        assert here().sharding is marker
        with using_sharding(None):
            assert here().sharding is None
        assert here().sharding is marker
    assert here().sharding is None
    assert xla_loop_body(lambda: here().in_xla_loop)() and not here().in_xla_loop
