"""`plan_update`: a train step's update run one block of layers at a time, in a rolled loop.

Compiled as users run it (`jit(backend="inductor")`, donated state), the blockwise update must give
the whole update's bits; the check that allows it must refuse a transformation that mixes blocks or
treats them differently (eagerly, where the plan is made on real tensors).
"""

from __future__ import annotations

import pytest
import torch

from ember import optim
from ember.core import TrainState, jit, random
from ember.core.pytree import tree_map, tree_map_with_path
from ember.core.rolled_loop import _REGISTRY
from ember.core.step_fns import blockwise_update, cross_entropy, train_step
from ember.core.step_fns.blockwise_update import MIN_BLOCKS, BlockwiseUpdate
from ember.core.testing import assert_trees_all_equal

D, CLASSES = 8, 3


def init_params(key, blocks=MIN_BLOCKS):
    keys = random.split(key, blocks + 2)
    return {
        "embed": random.normal(keys[0], (D, D)) * D**-0.5,
        "blocks": [{"w": random.normal(k, (D, D)) * D**-0.5, "scale": torch.ones(D)} for k in keys[1:-1]],
        "out": random.normal(keys[-1], (D, CLASSES)) * D**-0.5,
    }


def loss_fn(params, batch, *, key):
    h = batch["x"] @ params["embed"]
    for block in params["blocks"]:
        h = h + torch.tanh(h @ block["w"]) * block["scale"]
    return cross_entropy(h @ params["out"], batch["y"])


def batch(seed):
    k1, k2 = random.split(random.key(seed))
    return {"x": random.normal(k1, (16, D)), "y": random.randint(k2, (16,), 0, CLASSES)}


def default_tx():
    return optim.from_config(optim.OptimConfig(name="adamw", learning_rate=1e-2), total_steps=10)


def train(tx, steps=3):
    state = TrainState.create(params=init_params(random.key(0)), tx=tx, key=random.key(1))
    step = jit(train_step(loss_fn), backend="inductor", donate="state")
    metrics = []
    for i in range(steps):
        state, m = step(state, batch(i))
        metrics.append(m)
    return state, metrics


@pytest.mark.parametrize("make_tx", [default_tx, lambda: optim.sgd(0.1, momentum=0.9, nesterov=True)],
                         ids=["clip_adamw_mask_schedule", "sgd_nesterov"])
def test_the_blockwise_update_gives_the_whole_updates_bits(make_tx, monkeypatch):
    loops = _REGISTRY.counts.get("ember.train_step.update0", -1)
    state, metrics = train(make_tx())
    assert _REGISTRY.counts.get("ember.train_step.update0", -1) > loops  # the blocks went through a loop
    monkeypatch.setattr(blockwise_update, "MIN_BLOCKS", 10**9)  # every update whole
    whole_state, whole_metrics = train(make_tx())
    assert_trees_all_equal(state.params, whole_state.params)
    assert_trees_all_equal(state.opt_state, whole_state.opt_state)
    assert_trees_all_equal(metrics, whole_metrics)


def plan(tx, params=None):
    params = init_params(random.key(0)) if params is None else params
    grads = tree_map_with_path(lambda path, p: torch.full_like(p, 0.1 + len(path) / 100), params)
    return BlockwiseUpdate.make(tx, grads, tx.init(params), params)


@pytest.mark.parametrize("make_tx", [default_tx, lambda: optim.lion(1e-3), lambda: optim.adam(1e-3)],
                         ids=["clip_adamw_mask_schedule", "lion", "adam"])
def test_an_update_that_treats_blocks_alike_and_apart_is_planned_blockwise(make_tx):
    got = plan(make_tx())
    assert got is not None
    assert [len(run) for run in got.runs] == [MIN_BLOCKS]


def test_clipping_the_inputs_norm_reads_the_norm_of_every_leaf():
    assert plan(default_tx()).uses_norm
    assert not plan(optim.adam(1e-3)).uses_norm


def test_an_update_that_mixes_or_tells_blocks_apart_runs_whole():
    # a norm of something else than its input (adam's output): a sum over every block
    assert plan(optim.chain(optim.scale_by_adam(), optim.clip_by_global_norm(1.0))) is None
    # a mask that picks the first block out
    first_only = lambda params: tree_map_with_path(lambda path, _: path.startswith("blocks.0."), params)  # noqa: E731
    assert plan(optim.masked(optim.add_decayed_weights(0.1), first_only)) is None
    # one tensor in two blocks (tied weights)
    params = init_params(random.key(0))
    params["blocks"][1]["w"] = params["blocks"][0]["w"]
    assert plan(optim.adam(1e-3), params) is None
    # too few blocks to roll
    assert plan(optim.adam(1e-3), init_params(random.key(0), blocks=MIN_BLOCKS - 1)) is None


def test_without_donation_the_blockwise_update_leaves_the_callers_state_alone():
    loops = _REGISTRY.counts.get("ember.train_step.update0", -1)
    state = TrainState.create(params=init_params(random.key(0)), tx=default_tx(), key=random.key(1))
    kept = tree_map(torch.clone, state)
    new, _ = jit(train_step(loss_fn), backend="inductor")(state, batch(0))
    assert _REGISTRY.counts.get("ember.train_step.update0", -1) > loops
    assert_trees_all_equal(state, kept)
    donated, _ = jit(train_step(loss_fn), backend="inductor", donate="state")(kept, batch(0))
    assert_trees_all_equal(new.params, donated.params)
    assert_trees_all_equal(new.opt_state, donated.opt_state)
