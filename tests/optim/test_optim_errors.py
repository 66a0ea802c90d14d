"""Misuse of ember.optim fails early, with a message naming the subject and the fix."""

from __future__ import annotations

import pytest
import torch
from optim_testlib import mlp_params

from ember import optim


def _adamw_state():
    return optim.adamw(1e-3).init(mlp_params())


def _update_with_foreign_state():
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.scale_by_adam(), optim.scale(-1e-3))
    other = optim.chain(optim.scale_by_adam(), optim.scale(-1e-3))
    params = mlp_params()
    tx.update(params, other.init(params), params)


def _update_with_non_tuple_state():
    tx = optim.chain(optim.scale(1.0))
    tx.update(mlp_params(), optim.scale_by_adam().init(mlp_params()))


def _masked_with_wrong_tree():
    params = mlp_params()
    mask = {"l1": {"w": True, "b": False}, "l3": {"w": True, "b": False}}
    optim.adamw(1e-3, mask=mask).init(params)


def _masked_with_tensor_leaves():
    params = mlp_params()
    mask = {"l1": {"w": torch.tensor(True), "b": False}, "l2": {"w": True, "b": False}}
    optim.masked(optim.scale(0.0), mask).init(params)


ERROR_CASES = [  # (id, callable that must raise, exception type, regex on the message)
    (
        "schedule_returns_python_float",
        lambda: optim.adamw(lambda count: 1e-3),
        TypeError,
        r"'learning_rate' returned 0\.001 \(a float\).*torch\.as_tensor",
    ),
    (
        "schedule_returns_vector",
        lambda: optim.sgd(lambda count: torch.ones(2)),
        TypeError,
        r"'learning_rate'.*shape \(2,\)",
    ),
    (
        "scale_by_schedule_returns_float",
        lambda: optim.scale_by_schedule(lambda c: 0.5).update(
            {"w": torch.ones(1)}, optim.scale_by_schedule(lambda c: 0.5).init({"w": torch.ones(1)})
        ),
        TypeError,
        r"'step_size'.*0-d tensor",
    ),
    (
        "mask_tree_mismatch",
        _masked_with_wrong_tree,
        ValueError,
        r"only in the first: \['l3\.b', 'l3\.w'\]; only in the second: \['l2\.b', 'l2\.w'\]",
    ),
    (
        "mask_leaf_not_bool",
        _masked_with_tensor_leaves,
        TypeError,
        r"mask leaf at 'l1\.w' is a Tensor",
    ),
    (
        "chain_state_count_mismatch",
        _update_with_foreign_state,
        ValueError,
        r"3 transformations.*2 states.*call init first",
    ),
    (
        "chain_state_not_a_tuple",
        _update_with_non_tuple_state,
        ValueError,
        r"ScaleByAdamState.*call init first",
    ),
    (
        "chain_uncalled_factory",
        lambda: optim.chain(optim.scale_by_adam),
        TypeError,
        r"argument 0.*without calling",
    ),
    (
        "set_unknown_hyperparam",
        lambda: optim.set_hyperparams(_adamw_state(), learning_rat=1e-4),
        ValueError,
        r"unknown hyperparameter 'learning_rat'; the state knows "
        r"\['b1', 'b2', 'eps', 'learning_rate', 'weight_decay'\]\. Did you mean 'learning_rate'",
    ),
    (
        "set_scheduled_hyperparam",
        lambda: optim.set_hyperparams(
            optim.sgd(optim.constant_schedule(0.1)).init(mlp_params()), learning_rate=0.2
        ),
        ValueError,
        r"'learning_rate' is driven by a schedule",
    ),
    (
        "set_on_state_without_hyperparams",
        lambda: optim.set_hyperparams(optim.scale_by_adam().init(mlp_params()), learning_rate=0.1),
        ValueError,
        r"no InjectHyperparamsState.*inject_hyperparams",
    ),
    (
        "set_non_scalar",
        lambda: optim.set_hyperparams(_adamw_state(), learning_rate=torch.ones(3)),
        ValueError,
        r"'learning_rate' must be a scalar.*\(3,\)",
    ),
    (
        "inject_unknown_static_arg",
        lambda: optim.inject_hyperparams(optim.scale_by_adam, static_args=("mask",)),
        ValueError,
        r"\['mask'\].*not parameters of scale_by_adam",
    ),
    (
        "weight_decay_needs_params",
        lambda: optim.add_decayed_weights(0.1).update({"w": torch.ones(1)}, None),
        ValueError,
        r"add_decayed_weights\.update needs `params`",
    ),
    (
        "weight_decay_callable",
        lambda: optim.add_decayed_weights(lambda c: 0.1),
        TypeError,
        r"inject_hyperparams\(add_decayed_weights",
    ),
    ("scale_callable", lambda: optim.scale(lambda c: 0.1), TypeError, r"scale_by_schedule"),
    ("adam_beta_out_of_range", lambda: optim.adamw(1e-3, b2=1.5), ValueError, r"b2=1\.5"),
    ("clip_non_positive", lambda: optim.clip_by_global_norm(0.0), ValueError, r"max_norm=0\.0"),
    (
        "sgd_nesterov_without_momentum",
        lambda: optim.sgd(0.1, nesterov=True),
        ValueError,
        r"nesterov=True\) needs a momentum",
    ),
    (
        "multi_steps_zero",
        lambda: optim.multi_steps(optim.sgd(0.1), every_k=0),
        ValueError,
        r"every_k=0",
    ),
    (
        "multi_steps_float",
        lambda: optim.multi_steps(optim.sgd(0.1), every_k=2.0),
        TypeError,
        r"expects an int.*float",
    ),
    (
        "cosine_zero_steps",
        lambda: optim.cosine_decay_schedule(1.0, 0),
        ValueError,
        r"decay_steps > 0.*decay_steps=0",
    ),
    (
        "warmup_longer_than_total",
        lambda: optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=10),
        ValueError,
        r"decay_steps > warmup_steps.*warmup_steps=10, decay_steps=10",
    ),
    (
        "join_boundary_count",
        lambda: optim.join_schedules([optim.constant_schedule(1.0)] * 3, [5]),
        ValueError,
        r"3 schedules and 1 boundaries",
    ),
]


@pytest.mark.parametrize(
    "fn,exc,match", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_error(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()
