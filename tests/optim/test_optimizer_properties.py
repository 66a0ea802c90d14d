"""Every optimizer in OPTIMIZERS_UNDER_TEST crossed with the properties an optimizer must have.

Convergence on a quadratic; bf16 params keep bf16 updates and state dtypes; state structure,
shapes and dtypes are stable across updates; `init` (and `update`) work on meta tensors; `update`
never mutates its inputs; hyperparameters are float32 tensors reachable by get/set_hyperparams.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from optim_testlib import (
    CASE_IDS,
    OPTIMIZERS_UNDER_TEST,
    mlp_grad,
    mlp_params,
    quadratic_grad,
    quadratic_loss,
    quadratic_params,
    run_steps,
)

from ember import optim
from ember.core import pytree

CASES = pytest.mark.parametrize("case", OPTIMIZERS_UNDER_TEST, ids=CASE_IDS)


def _signature(tree):
    """(path, shape, dtype, device) per leaf, plus the tree structure."""
    leaves = [
        (p, tuple(t.shape), t.dtype, t.device.type) for p, t in pytree.tree_leaves_with_path(tree)
    ]
    return pytree.tree_structure(tree), leaves


@CASES
def test_converges_on_quadratic(case):
    params, _ = run_steps(case.make(), quadratic_params(), quadratic_grad, case.converge_steps)
    start = float(quadratic_loss(quadratic_params()))
    assert float(quadratic_loss(params)) < 1e-2 * start


@CASES
def test_state_structure_and_dtypes_are_stable(case):
    tx = case.make()
    params = mlp_params()
    state = tx.init(params)
    before = _signature(state)
    for _ in range(3):
        updates, state = tx.update(mlp_grad(params), state, params)
        params = optim.apply_updates(params, updates)
        assert _signature(state) == before
        assert _signature(updates) == _signature(params)


@CASES
def test_bf16_params_give_bf16_updates_and_stable_state(case):
    tx = case.make()
    params = quadratic_params(torch.bfloat16)
    state = tx.init(params)
    before = _signature(state)
    for _ in range(3):
        updates, state = tx.update(quadratic_grad(params), state, params)
        assert all(u.dtype == torch.bfloat16 for u in pytree.tree_leaves(updates))
        params = optim.apply_updates(params, updates)
        assert _signature(state) == before
    assert all(p.dtype == torch.bfloat16 for p in pytree.tree_leaves(params))
    # Hyperparameters stay float32 whatever the params are (bf16 would round b2=0.999 to 1.0).
    assert all(h.dtype == torch.float32 for h in optim.get_hyperparams(state).values())


@CASES
def test_init_and_update_on_meta_tensors(case):
    tx = case.make()
    meta = pytree.tree_map(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), mlp_params()
    )
    state = tx.init(meta)
    real = tx.init(mlp_params())
    structure, leaves = _signature(state)
    real_structure, real_leaves = _signature(real)
    assert structure == real_structure
    assert [(p, s, d) for p, s, d, _ in leaves] == [(p, s, d) for p, s, d, _ in real_leaves]
    assert {dev for *_, dev in leaves} == {"meta"}
    # update runs abstractly too (like jax.eval_shape), and keeps the state's signature
    updates, new_state = tx.update(meta, state, meta)
    assert _signature(new_state) == _signature(state)
    assert _signature(updates) == _signature(meta)


@CASES
def test_update_is_pure(case):
    tx = case.make()
    params = mlp_params()
    state = tx.init(params)
    _, state = tx.update(mlp_grad(params), state, params)  # non-trivial state
    grads = mlp_grad(params)
    snapshot = [t.clone() for t in pytree.tree_leaves((grads, state, params))]
    first = tx.update(grads, state, params)
    for before, after in zip(snapshot, pytree.tree_leaves((grads, state, params))):
        assert torch.equal(before, after)  # no input was modified in place
    second = tx.update(grads, state, params)
    for a, b in zip(pytree.tree_leaves(first), pytree.tree_leaves(second)):
        assert torch.equal(a, b)


@CASES
def test_state_leaves_keep_the_param_paths(case):
    # Sharding rules give optimizer state its parameter's spec by path: every non-scalar state
    # leaf sits under the path of a parameter (e.g. `...mu.l1.w`), with that parameter's shape
    # unless it is a factored moment (Adafactor's v_row / v_col drop one dim).
    params = mlp_params()
    param_shapes = {p: tuple(t.shape) for p, t in pytree.tree_leaves_with_path(params)}
    state = case.make().init(params)
    for path, leaf in pytree.tree_leaves_with_path(state):
        if leaf.ndim == 0:
            continue  # counts and hyperparameters
        owner = [p for p in param_shapes if path.endswith("." + p)]
        assert len(owner) == 1, path
        if ".v_row." not in path and ".v_col." not in path:
            assert tuple(leaf.shape) == param_shapes[owner[0]], path


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@CASES
def test_update_never_syncs_with_the_host(case):
    # A `.item()` (aten._local_scalar_dense) would stall a GPU step and break torch.compile's
    # fullgraph; e.g. torch._foreach_add(list, tensor) silently takes the Scalar overload.
    tx = case.make()
    params = mlp_params()
    state, grads = tx.init(params), mlp_grad(params)
    with _RecordOps() as rec:
        tx.update(grads, state, params)
    assert rec.ops, "nothing was recorded"
    assert not [op for op in rec.ops if "_local_scalar_dense" in op or op.startswith("aten.item")]


@CASES
def test_hyperparameters_are_float32_tensors_with_a_learning_rate(case):
    state = case.make().init(mlp_params())
    hyperparams = optim.get_hyperparams(state)
    assert "learning_rate" in hyperparams
    for name, value in hyperparams.items():
        assert value.shape == () and value.dtype == torch.float32, name
    paths = pytree.tree_paths(state)
    assert any(p.endswith("hyperparams.learning_rate") for p in paths), paths


INJECT_EQUIVALENCE = [  # (id, alias, the same chain built by hand with Python floats)
    (
        "adamw",
        lambda: optim.adamw(1e-2, weight_decay=0.1, mask=optim.decay_mask),
        lambda: optim.chain(
            optim.scale_by_adam(0.9, 0.999, 1e-8),
            optim.add_decayed_weights(0.1, mask=optim.decay_mask),
            optim.scale_by_learning_rate(1e-2),
        ),
    ),
    (
        "sgd_nesterov",
        lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda: optim.chain(
            optim.add_decayed_weights(1e-3),
            optim.trace(0.9, nesterov=True),
            optim.scale_by_learning_rate(0.05),
        ),
    ),
    (
        "lion",
        lambda: optim.lion(1e-3),
        lambda: optim.chain(
            optim.scale_by_lion(0.9, 0.99), optim.add_decayed_weights(1e-3), optim.scale(-1e-3)
        ),
    ),
]


@pytest.mark.parametrize(
    "alias,by_hand", [c[1:] for c in INJECT_EQUIVALENCE], ids=[c[0] for c in INJECT_EQUIVALENCE]
)
def test_alias_equals_its_chain_with_python_floats(alias, by_hand):
    # Same math; the alias holds float32 hyperparameters, the hand-built chain Python doubles.
    a, _ = run_steps(alias(), mlp_params(), mlp_grad, 10)
    b, _ = run_steps(by_hand(), mlp_params(), mlp_grad, 10)
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
