"""`assert_pure` on steps that donate their state: recognised, checked on a fresh copy per call."""

import functools

import pytest
import torch

from ember.core.jit import jit
from ember.core.testing import assert_pure


def sgd_step(state, batch):
    new = {"w": state["w"] - 0.5 * batch}
    return new, {"norm": new["w"].norm()}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_donating_step_passes_and_leaves_the_callers_state_alone(backend):
    state, batch = {"w": torch.ones(3)}, torch.ones(3)
    new, metrics = assert_pure(jit(sgd_step, backend=backend, donate="state"), state, batch)
    assert new["w"].tolist() == [0.5] * 3 and metrics["norm"].item() == pytest.approx(0.75 ** 0.5)
    assert state["w"].tolist() == [1.0] * 3 and state["w"]._version == 0
    assert new["w"] is not state["w"]


def test_a_step_wrapping_a_donating_step_is_recognised():
    donating = jit(sgd_step, backend="eager", donate="state")

    @functools.wraps(donating)
    def wrapped(state, batch):
        return donating(state, batch)

    for step in (wrapped, functools.partial(donating), functools.partial(wrapped)):
        assert_pure(step, {"w": torch.ones(2)}, torch.ones(2))


def test_a_donating_step_that_writes_another_input_is_still_blamed():
    def writes_batch(state, batch):
        batch.mul_(2.0)
        return sgd_step(state, batch)

    with pytest.raises(AssertionError, match=r"modified its input args\[1\] in place") as info:
        assert_pure(jit(writes_batch, backend="eager", donate="state"), {"w": torch.ones(2)}, torch.ones(2))
    assert "donate" not in str(info.value)


def test_a_nondeterministic_donating_step_is_still_caught():
    def noisy(state, batch):
        return {"w": state["w"] + torch.rand(())}, {}

    with pytest.raises(AssertionError, match=r"not deterministic"):
        assert_pure(jit(noisy, backend="eager", donate="state"), {"w": torch.ones(2)}, torch.ones(2))


def test_an_unrecognisable_donating_wrapper_gets_the_fix_in_the_message():
    donating = jit(sgd_step, backend="eager", donate="state")
    hidden = lambda state, batch: donating(state, batch)  # noqa: E731 - no __wrapped__ to follow

    with pytest.raises(AssertionError, match=r"args\[0\]\.w in place[\s\S]*donate=\"state\"[\s\S]*"
                                             r"pass that jitted function itself"):
        assert_pure(hidden, {"w": torch.ones(2)}, torch.ones(2))


def test_a_non_donating_jitted_step_is_checked_on_the_callers_inputs():
    def mutates(state, batch):
        state["w"].sub_(batch)
        return state

    with pytest.raises(AssertionError, match=r"args\[0\]\.w in place"):
        assert_pure(jit(mutates, backend="eager"), {"w": torch.ones(2)}, torch.ones(2))
