"""inject_hyperparams, set_hyperparams, get_hyperparams: hyperparameters as tensors in the state."""

from __future__ import annotations

import pytest
import torch
from optim_testlib import mlp_grad, mlp_params, run_steps

from ember import optim
from ember.core import TrainState, pytree


def test_alias_state_holds_float32_hyperparams_in_signature_order():
    state = optim.adamw(1e-3, b1=0.8, weight_decay=0.05).init(mlp_params())
    assert isinstance(state, optim.InjectHyperparamsState)
    assert list(state.hyperparams) == ["learning_rate", "b1", "b2", "eps", "weight_decay"]
    assert state.hyperparams["b1"].item() == pytest.approx(0.8)
    assert state.count.dtype == torch.int64 and state.count.shape == ()
    assert state.scheduled == ()


def test_schedule_value_is_stored_for_the_step_that_used_it():
    schedule = optim.linear_schedule(0.0, 1.0, transition_steps=10)
    tx = optim.sgd(schedule)
    params = {"w": torch.zeros(2)}
    state = tx.init(params)
    assert state.scheduled == ("learning_rate",)
    assert state.hyperparams["learning_rate"].item() == 0.0  # value at count 0
    for step in range(4):
        updates, state = tx.update({"w": torch.ones(2)}, state, params)
        used = schedule(torch.tensor(step)).item()
        assert state.hyperparams["learning_rate"].item() == pytest.approx(used)
        assert updates["w"][0].item() == pytest.approx(-used)
    assert state.count.item() == 4


def test_set_hyperparams_changes_the_update_and_leaves_the_input_alone():
    tx = optim.sgd(0.1)
    params = {"w": torch.zeros(2)}
    state = tx.init(params)
    new = optim.set_hyperparams(state, learning_rate=0.5)
    assert state.hyperparams["learning_rate"].item() == pytest.approx(0.1)  # pure
    assert new.hyperparams["learning_rate"].dtype == torch.float32
    updates, _ = tx.update({"w": torch.ones(2)}, new, params)
    assert updates["w"].tolist() == [-0.5, -0.5]


def test_set_hyperparams_accepts_tensors_and_keeps_device_and_dtype():
    state = optim.adam(1e-3).init(mlp_params())
    new = optim.set_hyperparams(
        state, learning_rate=torch.tensor(2e-3, dtype=torch.float64), b1=0.5
    )
    assert new.hyperparams["learning_rate"].dtype == torch.float32
    assert new.hyperparams["learning_rate"].shape == ()
    assert new.hyperparams["b1"].item() == 0.5


def test_set_and_get_find_nested_states():
    # chain(clip, adamw) inside multi_steps inside a TrainState
    tx = optim.multi_steps(
        optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)), every_k=2
    )
    ts = TrainState.create(params=mlp_params(), tx=tx)
    ts2 = optim.set_hyperparams(ts, learning_rate=5e-4)
    assert isinstance(ts2, TrainState)
    assert optim.get_hyperparams(ts2.opt_state)["learning_rate"].item() == pytest.approx(5e-4)
    assert optim.get_hyperparams(ts.opt_state)["learning_rate"].item() == pytest.approx(1e-3)
    paths = pytree.tree_paths(ts2)
    assert any(p.endswith("hyperparams.learning_rate") for p in paths)


def test_set_hyperparams_sets_every_state_that_has_the_name():
    tx = optim.chain(optim.adam(1e-3), optim.sgd(1.0))
    state = optim.set_hyperparams(tx.init(mlp_params()), learning_rate=0.25)
    assert [s.hyperparams["learning_rate"].item() for s in state] == [0.25, 0.25]


def test_inject_hyperparams_on_a_building_block_with_a_schedule():
    b1 = optim.linear_schedule(0.5, 0.9, transition_steps=5)
    tx = optim.inject_hyperparams(optim.scale_by_adam)(b1=b1, b2=0.99)
    params = mlp_params()
    p, state = run_steps(tx, params, mlp_grad, 3)
    assert state.hyperparams["b1"].item() == pytest.approx(b1(torch.tensor(2)).item())
    assert state.inner_state.count.item() == 3
    # static_args keeps a callable out of the schedules
    masked_decay = optim.inject_hyperparams(optim.add_decayed_weights, static_args="mask")(
        weight_decay=optim.constant_schedule(0.1), mask=optim.decay_mask
    )
    updates, _ = masked_decay.update(
        pytree.tree_map(torch.zeros_like, params), masked_decay.init(params), params
    )
    assert torch.equal(updates["l1"]["b"], torch.zeros(16))
    torch.testing.assert_close(updates["l1"]["w"], 0.1 * params["l1"]["w"])


def test_get_hyperparams_of_a_state_without_any_is_empty():
    assert optim.get_hyperparams(optim.scale_by_adam().init(mlp_params())) == {}
