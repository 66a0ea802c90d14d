"""multi_steps(inner, k) over k * n calls equals `inner` on the k-averaged gradients."""

from __future__ import annotations

import pytest
import torch
from optim_testlib import max_abs_diff, mlp_grad, mlp_params

from ember import optim
from ember.core import pytree

K, N = 3, 4

INNER_CASES = [
    ("adamw", lambda: optim.adamw(1e-2, weight_decay=0.1, mask=optim.decay_mask)),
    ("sgd_momentum_cosine", lambda: optim.sgd(optim.cosine_decay_schedule(0.1, N), momentum=0.9)),
    ("adafactor", lambda: optim.adafactor(1e-2, min_dim_size_to_factor=4)),
]


def _micro_grads(params, i):
    """Gradient of micro-batch `i`: the MLP gradient plus a deterministic per-call offset."""
    g = torch.Generator().manual_seed(100 + i)
    return pytree.tree_map(lambda t: t + 0.05 * torch.randn(t.shape, generator=g), mlp_grad(params))


@pytest.mark.parametrize("make_inner", [c[1] for c in INNER_CASES], ids=[c[0] for c in INNER_CASES])
def test_multi_steps_equals_inner_on_averaged_gradients(make_inner):
    tx = optim.multi_steps(make_inner(), every_k=K)
    params = mlp_params()
    state = tx.init(params)
    for call in range(K * N):
        updates, state = tx.update(_micro_grads(params, call), state, params)
        if call % K != K - 1:  # accumulating: exactly zero updates, params unchanged
            assert all(torch.all(u == 0) for u in pytree.tree_leaves(updates))
        params = optim.apply_updates(params, updates)
    assert state.gradient_step.item() == N and state.mini_step.item() == 0

    ref_tx = make_inner()
    ref = mlp_params()
    ref_state = ref_tx.init(ref)
    for step in range(N):
        micro = [_micro_grads(ref, step * K + j) for j in range(K)]
        mean = pytree.tree_map(lambda *gs: torch.stack(gs).mean(0), *micro)
        updates, ref_state = ref_tx.update(mean, ref_state, ref)
        ref = optim.apply_updates(ref, updates)

    # Welford's running mean and stack().mean() round differently (a few float32 ulps).
    assert max_abs_diff(params, ref) < 1e-6
    assert max_abs_diff(state.inner_state, ref_state) < 1e-6
    assert max_abs_diff(params, mlp_params()) > 1e-3  # it trained


def test_every_k_one_is_the_inner_optimizer():
    params = mlp_params()
    a, b = optim.multi_steps(optim.adam(1e-2), every_k=1), optim.adam(1e-2)
    sa, sb = a.init(params), b.init(params)
    for _ in range(3):
        ua, sa = a.update(mlp_grad(params), sa, params)
        ub, sb = b.update(mlp_grad(params), sb, params)
        assert max_abs_diff(ua, ub) == 0.0
        params = optim.apply_updates(params, ua)


def test_accumulator_is_float32_for_bf16_params():
    params = pytree.tree_map(lambda t: t.to(torch.bfloat16), mlp_params())
    state = optim.multi_steps(optim.sgd(0.1), every_k=2).init(params)
    assert {t.dtype for t in pytree.tree_leaves(state.acc_grads)} == {torch.float32}
