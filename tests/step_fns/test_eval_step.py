"""Tests for `ember.core.step_fns.eval_step` and the step_fns docstring examples."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

from ember import optim
from ember.core import TrainState, random
from ember.core.step_fns import eval_step, train_step
from ember.core.testing import assert_pure, assert_trees_all_close


def loss_fn(params, batch, *, key):
    h = batch["x"] @ params["w"]  # (B, C)
    if key is not None:  # training: dropout; evaluation gets key=None
        h = random.dropout(key, h, 0.5)
    err = h - batch["y"]
    return (err**2).mean(), {"mae": err.abs().mean()}


def make():
    params = {"w": random.normal(random.key(0), (4, 3))}
    batch = {"x": random.normal(random.key(1), (6, 4)), "y": random.normal(random.key(2), (6, 3))}
    return params, batch


def test_eval_is_deterministic_pure_and_matches_direct_loss():
    params, batch = make()
    metrics = assert_pure(eval_step(loss_fn), params, batch)
    loss, aux = loss_fn(params, batch, key=None)
    assert_trees_all_close(metrics, {"loss": loss, "mae": aux["mae"]}, rtol=0, atol=0)


def test_accepts_train_state_and_params_alike():
    params, batch = make()
    state = TrainState.create(params=params, tx=optim.sgd(0.1), key=random.key(3))
    step = eval_step(loss_fn)
    assert_trees_all_close(step(state, batch), step(params, batch), rtol=0, atol=0)


def test_eval_after_train_step_sees_new_params():
    params, batch = make()
    state = TrainState.create(params=params, tx=optim.sgd(0.1), key=random.key(3))
    new_state, _ = train_step(loss_fn)(state, batch)
    step = eval_step(loss_fn)
    assert step(new_state, batch)["loss"] != step(state, batch)["loss"]


def test_compute_dtype_and_float32_metrics():
    params, batch = make()
    metrics = eval_step(loss_fn, compute_dtype=torch.bfloat16)(params, batch)
    ref = eval_step(loss_fn)(params, batch)
    assert all(v.dtype == torch.float32 for v in metrics.values())
    assert_trees_all_close(metrics, ref, rtol=3e-2, atol=1e-2)  # bf16: ~2**-8 relative per op


def test_no_gradients_are_recorded():
    params, batch = make()
    params = {"w": params["w"].requires_grad_()}
    assert not eval_step(loss_fn)(params, batch)["loss"].requires_grad


def test_traces_whole_without_graph_breaks(assert_single_graph):
    metrics = assert_single_graph(eval_step(loss_fn), *make())
    assert_trees_all_close(metrics, eval_step(loss_fn)(*make()))


ERRORS = [
    ("not_callable", lambda: eval_step(3), TypeError, r"callable `loss_fn"),
    ("bad_dtype", lambda: eval_step(loss_fn, compute_dtype=torch.int8), TypeError, r"floating"),
    ("vector_loss", lambda: eval_step(lambda p, b, *, key: b["x"].sum(-1))(*make()), ValueError,
     r"0-d \(scalar\) loss tensor; the loss has shape \(6,\)"),
    ("aux_named_loss", lambda: eval_step(lambda p, b, *, key: (b["x"].sum(), {"loss": b["x"].sum()}))(
        *make()), ValueError, r"'loss' collides"),
]


@pytest.mark.parametrize("name,call,exc,match", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


MODULES = [
    "ember.core.step_fns.losses",
    "ember.core.step_fns.train_step",
    "ember.core.step_fns.eval_step",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
