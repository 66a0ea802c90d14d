"""The building blocks one by one: identity, chain, clipping, masking, scaling, momentum, ..."""

from __future__ import annotations

import pytest
import torch
from optim_testlib import mlp_grad, mlp_params

from ember import optim
from ember.core import pytree, tree_math


def _update(tx, grads, params=None, steps=1):
    state = tx.init(params if params is not None else grads)
    for _ in range(steps):
        out, state = tx.update(grads, state, params)
    return out, state


def test_apply_updates_is_cores():
    assert optim.apply_updates is tree_math.apply_updates


def test_identity_returns_the_updates():
    grads = mlp_grad(mlp_params())
    out, state = _update(optim.identity(), grads)
    assert out is grads and isinstance(state, optim.EmptyState)
    assert pytree.tree_leaves(state) == []


def test_chain_applies_in_order():
    grads = {"w": torch.tensor([3.0, 4.0])}
    clip_then_scale, _ = _update(
        optim.chain(optim.clip_by_global_norm(1.0), optim.scale(10.0)), grads
    )
    scale_then_clip, _ = _update(
        optim.chain(optim.scale(10.0), optim.clip_by_global_norm(1.0)), grads
    )
    torch.testing.assert_close(clip_then_scale["w"], torch.tensor([6.0, 8.0]))
    torch.testing.assert_close(scale_then_clip["w"], torch.tensor([0.6, 0.8]))


@pytest.mark.parametrize("max_norm", [2.0, torch.tensor(2.0)], ids=["float", "tensor"])
def test_clip_by_global_norm(max_norm):
    small = {"a": torch.tensor([0.3, 0.4]), "b": torch.tensor([[1.0]])}  # norm ~1.04
    out, _ = _update(optim.clip_by_global_norm(max_norm), small)
    assert all(torch.equal(out[k], small[k]) for k in small)  # untouched below the threshold
    big = pytree.tree_map(lambda t: 10 * t, small)
    out, _ = _update(optim.clip_by_global_norm(max_norm), big)
    assert tree_math.global_norm(out).item() == pytest.approx(2.0, rel=1e-6)
    torch.testing.assert_close(
        out["a"] / out["a"].norm(), big["a"] / big["a"].norm()
    )  # direction kept


def test_clip_by_block_rms_bounds_each_leaf():
    grads = {"a": torch.full((4,), 3.0), "b": torch.full((2, 2), 0.5)}
    out, _ = _update(optim.clip_by_block_rms(1.0), grads)
    torch.testing.assert_close(out["a"], torch.full((4,), 1.0))
    assert torch.equal(out["b"], grads["b"])


def test_clip_bounds_each_element_and_refuses_a_non_positive_bound():
    tx = optim.clip(0.5)
    updates, _ = tx.update({"w": torch.tensor([2.0, -3.0, 0.25])}, tx.init(None))
    assert updates["w"].tolist() == [0.5, -0.5, 0.25]
    with pytest.raises(ValueError, match=r"clip\(max_delta=...\) must be positive, got max_delta=0"):
        optim.clip(0)


def test_zero_nans_zeroes_nans_records_the_leaves_and_lets_infs_pass():
    tx = optim.zero_nans()
    state = tx.init({"a": torch.zeros(3), "b": torch.zeros(2)})
    grads = {"a": torch.tensor([1.0, float("nan"), float("inf")]), "b": torch.tensor([1.0, 2.0])}
    updates, state = tx.update(grads, state)
    assert updates["a"].tolist() == [1.0, 0.0, float("inf")] and torch.equal(updates["b"], grads["b"])
    assert bool(state.found_nan["a"]) and not bool(state.found_nan["b"])


def test_masked_passes_masked_out_updates_through():
    params = mlp_params()
    grads = mlp_grad(params)
    mask = optim.decay_mask(params)
    assert mask == {"l1": {"w": True, "b": False}, "l2": {"w": True, "b": False}}
    tx = optim.masked(optim.scale_by_adam(), mask)
    out, state = _update(tx, grads, params, steps=2)
    assert out["l1"]["b"] is grads["l1"]["b"] and out["l2"]["b"] is grads["l2"]["b"]
    assert not torch.equal(out["l1"]["w"], grads["l1"]["w"])
    # the inner state only covers the selected leaves, under the params' own paths
    assert pytree.tree_paths(state.inner_state.mu) == ["l1.w", "l2.w"]
    assert isinstance(state.inner_state.mu["l1"]["b"], optim.MaskedNode)
    # a callable mask, and update without params (the mask function then sees the updates)
    out2, _ = _update(optim.masked(optim.scale_by_adam(), optim.decay_mask), grads, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(out2)))


def test_add_decayed_weights_with_mask():
    params = mlp_params()
    zeros = pytree.tree_map(torch.zeros_like, params)
    out, _ = _update(optim.add_decayed_weights(0.5, mask=optim.decay_mask), zeros, params)
    torch.testing.assert_close(out["l2"]["w"], 0.5 * params["l2"]["w"])
    assert torch.equal(out["l2"]["b"], zeros["l2"]["b"])


@pytest.mark.parametrize(
    "lr",
    [0.25, torch.tensor(0.25), optim.constant_schedule(0.25)],
    ids=["float", "tensor", "schedule"],
)
def test_scale_by_learning_rate_negates(lr):
    grads = {"w": torch.tensor([1.0, -2.0])}
    out, _ = _update(optim.scale_by_learning_rate(lr), grads)
    assert out["w"].tolist() == [-0.25, 0.5]
    out, _ = _update(optim.scale_by_learning_rate(lr, flip_sign=False), grads)
    assert out["w"].tolist() == [0.25, -0.5]


def test_scale_by_schedule_counts_steps():
    tx = optim.scale_by_schedule(optim.linear_schedule(1.0, 0.0, transition_steps=4))
    grads = {"w": torch.ones(1)}
    state = tx.init(grads)
    seen = []
    for _ in range(3):
        out, state = tx.update(grads, state)
        seen.append(out["w"].item())
    assert seen == [1.0, 0.75, 0.5] and state.count.item() == 3


@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy_ball", "nesterov"])
def test_trace_matches_the_recurrence(nesterov):
    gs = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([-1.0])]
    tx = optim.trace(0.5, nesterov=nesterov)
    state = tx.init({"w": gs[0]})
    t = 0.0
    for g in gs:
        out, state = tx.update({"w": g}, state)
        t = 0.5 * t + g.item()
        assert out["w"].item() == pytest.approx(g.item() + 0.5 * t if nesterov else t)


def test_ema_debias():
    tx = optim.ema(0.9, debias=True)
    state = tx.init({"w": torch.zeros(1)})
    out, state = tx.update({"w": torch.tensor([2.0])}, state)
    assert out["w"].item() == pytest.approx(2.0)  # (0.1 * 2) / (1 - 0.9)
    assert state.ema["w"].item() == pytest.approx(0.2)


def test_lion_update_is_a_sign():
    grads = mlp_grad(mlp_params())
    out, state = _update(optim.scale_by_lion(), grads, steps=3)
    assert all(set(t.abs().unique().tolist()) <= {0.0, 1.0} for t in pytree.tree_leaves(out))
    assert state.count.item() == 3


def test_factored_rms_state_shapes():
    params = {
        "big": torch.ones(6, 5),
        "tall": torch.ones(2, 9),
        "vec": torch.ones(7),
        "t3": torch.ones(4, 5, 5),
    }
    tx = optim.scale_by_factored_rms(min_dim_size_to_factor=5)
    state = tx.init(params)
    shapes = lambda tree: {p: tuple(t.shape) for p, t in pytree.tree_leaves_with_path(tree)}  # noqa: E731
    # big: largest dim 0 (d0) and second 1 (d1); t3: equal dims 1 and 2 keep axis order (d1=1, d0=2)
    assert shapes(state.v_row) == {"big": (5,), "t3": (4, 5)}
    assert shapes(state.v_col) == {"big": (6,), "t3": (4, 5)}
    assert shapes(state.v) == {"tall": (2, 9), "vec": (7,)}
    grads = pytree.tree_map(lambda t: torch.full_like(t, 2.0), params)
    out, _ = tx.update(grads, state, params)
    # a constant gradient is normalised to ~1 everywhere, factored or not
    for t in pytree.tree_leaves(out):
        torch.testing.assert_close(t, torch.ones_like(t), rtol=1e-5, atol=0)


def test_param_block_rms_uses_min_scale_for_zero_params():
    params = {"zero": torch.zeros(4), "w": torch.full((4,), 3.0)}
    ones = pytree.tree_map(torch.ones_like, params)
    out, _ = _update(optim.scale_by_param_block_rms(1e-3), ones, params)
    torch.testing.assert_close(out["zero"], torch.full((4,), 1e-3))
    torch.testing.assert_close(out["w"], torch.full((4,), 3.0))


def test_empty_params_are_fine():
    for tx in (
        optim.adamw(1e-3),
        optim.sgd(0.1, momentum=0.9),
        optim.adafactor(1e-3),
        optim.lion(1e-3),
    ):
        state = tx.init({})
        out, state = tx.update({}, state, {})
        assert out == {}


def test_decay_mask_on_meta_tensors():
    meta = {"emb": torch.empty(10, 4, device="meta"), "norm": torch.empty(4, device="meta")}
    assert optim.decay_mask(meta) == {"emb": True, "norm": False}
