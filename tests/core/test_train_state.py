"""Tests for ember.core.TrainState."""

import pytest
import torch

from ember.core import TrainState, pytree, random


class _PlainSGD:
    """A minimal object with the GradientTransformation shape (no dependency on ember.optim)."""

    @staticmethod
    def init(params):
        return {}

    @staticmethod
    def update(grads, state, params=None):
        return pytree.tree_map(lambda g: -0.5 * g, grads), state


def test_create_and_apply_gradients():
    state = TrainState.create(params={"w": torch.ones(2)}, tx=_PlainSGD(), key=random.key(1))
    assert state.step.item() == 0 and state.skipped_steps.item() == 0
    new = state.apply_gradients(grads={"w": torch.ones(2)})
    assert new.step.item() == 1 and new.params["w"].tolist() == [0.5, 0.5]
    assert state.params["w"].tolist() == [1.0, 1.0]  # the old state is untouched
    assert pytree.tree_paths(new) == ["step", "params.w", "key", "skipped_steps"]


def test_tx_is_static_not_a_leaf():
    state = TrainState.create(params={"w": torch.ones(2)}, tx=_PlainSGD())
    assert all(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(state))


def test_subclass_with_user_fields():
    @pytree.dataclass
    class EmaState(TrainState):
        ema: dict = None

    s = EmaState.create(params={"w": torch.ones(1)}, tx=_PlainSGD(), ema={"w": torch.zeros(1)})
    assert "ema.w" in pytree.tree_paths(s)
    assert isinstance(s.apply_gradients(grads={"w": torch.ones(1)}), EmaState)


def test_create_rejects_non_transformation():
    with pytest.raises(TypeError, match=r"ember\.optim\.adamw"):
        TrainState.create(params={"w": torch.ones(1)}, tx=torch.optim.SGD)
