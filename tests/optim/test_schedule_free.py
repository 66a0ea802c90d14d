"""`schedule_free_adamw` equals `optax.contrib.schedule_free_adamw` (50 float32 steps, warmup and weight decay), and
so do the parameters to evaluate at (`schedule_free_eval_params`); a compiled step compiles once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optim_testlib import max_abs_diff, mlp_grad, mlp_params

from ember import optim
from ember.core import pytree

jax = pytest.importorskip("jax", reason="optax parity needs jax (pip install -e .[test])")
optax = pytest.importorskip("optax", reason="optax parity needs optax (pip install -e .[test])")

STEPS = 50
SETTINGS = dict(learning_rate=1e-2, warmup_steps=10, b1=0.9, b2=0.99, weight_decay=1e-3)


def _ours():
    tx = optim.schedule_free_adamw(**SETTINGS)
    params = mlp_params()
    state = tx.init(params)
    for _ in range(STEPS):
        updates, state = tx.update(mlp_grad(params), state, params)
        params = optim.apply_updates(params, updates)
    return params, optim.schedule_free_eval_params(state, params)


def _optax():
    to_jax = lambda t: pytree.tree_map(lambda a: jax.numpy.asarray(a.numpy()), t)  # noqa: E731
    to_torch = lambda t: jax.tree.map(lambda a: torch.from_numpy(np.array(a)), t)  # noqa: E731
    tx = optax.contrib.schedule_free_adamw(**SETTINGS)
    params = to_jax(mlp_params())
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(STEPS):
        updates, state = update(to_jax(mlp_grad(to_torch(params))), state, params)
        params = optax.apply_updates(params, updates)
    return to_torch(params), to_torch(optax.contrib.schedule_free_eval_params(state, params))


def test_schedule_free_adamw_and_its_eval_params_equal_optax():
    (params, eval_params), (want_params, want_eval) = _ours(), _optax()
    assert max_abs_diff(params, want_params) < 1e-6
    assert max_abs_diff(eval_params, want_eval) < 1e-6
    assert max_abs_diff(params, mlp_params()) > 1e-3  # it moved


def test_the_compiled_step_compiles_once_and_equals_eager():
    from ember.core import TrainState, jit
    from ember.core.step_fns import train_step
    from ember.core.testing import assert_max_compiles
    from optim_testlib import mlp_loss

    step_fn = train_step(lambda p, batch, key=None: mlp_loss(p))
    state = TrainState.create(params=mlp_params(), tx=optim.schedule_free_adamw(**SETTINGS))
    step = assert_max_compiles(jit(step_fn, backend="inductor"), n=1)
    compiled, eager = state, state
    for _ in range(3):
        compiled, _ = step(compiled, {})
        eager, _ = step_fn(eager, {})
    assert max_abs_diff(compiled.params, eager.params) < 1e-6


def test_eval_params_need_the_schedule_free_state():
    with pytest.raises(TypeError, match="needs an optimizer state holding one ScheduleFreeState .* got 0 in the EmptyState given"):
        optim.schedule_free_eval_params(optim.EmptyState(), mlp_params())
