"""ember.optim matches optax: optimizers over 50 MLP steps, and schedules over a grid of counts.

Both sides get their gradients from the same torch function of their own parameters. The optax
reference wraps its aliases in `optax.inject_hyperparams`, as ember's aliases are: both then hold
hyperparameters as float32, and the remaining difference is float32 rounding (at most 3e-7 here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optim_testlib import max_abs_diff, mlp_grad, mlp_params, run_steps

from ember import optim
from ember.core import pytree

jax = pytest.importorskip("jax", reason="optax parity needs jax (pip install -e .[test])")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax", reason="optax parity needs optax (pip install -e .[test])")

STEPS = 50
TOL = 1e-6  # measured 0 to 3e-7 (adam at lr 1e-2): float32 rounding of equal math, 50 steps
SCHED = dict(init_value=0.0, peak_value=3e-3, warmup_steps=10, decay_steps=50, end_value=1e-3)
CLIP = 0.15  # the initial global grad norm is about 0.21, so clipping is active early on


def _optax_decay_mask(params):
    return jax.tree.map(lambda x: x.ndim >= 2, params)


LAYER_LABELS = {"l1": {"w": "adamw", "b": "adamw"}, "l2": {"w": "sgd", "b": "sgd"}}  # a tree of labels


def _by_rank(params):  # a function of the params: matrices to one group, vectors to the other
    return jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "vector", params)


OPTAX_PARITY_CASES = [  # (id, ember factory, optax factory)
    (
        "clip_adamw_warmup_cosine_masked",
        lambda: optim.chain(
            optim.clip_by_global_norm(CLIP),
            optim.adamw(
                optim.warmup_cosine_decay_schedule(**SCHED), weight_decay=0.1, mask=optim.decay_mask
            ),
        ),
        lambda: optax.chain(
            optax.clip_by_global_norm(CLIP),
            optax.inject_hyperparams(optax.adamw, static_args="mask")(
                optax.warmup_cosine_decay_schedule(**SCHED),
                weight_decay=0.1,
                mask=_optax_decay_mask,
            ),
        ),
    ),
    (
        "partition_adamw_sgd_by_tree",
        lambda: optim.partition(
            {"adamw": optim.adamw(1e-2, weight_decay=0.1), "sgd": optim.sgd(5e-2, momentum=0.9)}, LAYER_LABELS
        ),
        lambda: optax.partition(
            {"adamw": optax.inject_hyperparams(optax.adamw)(1e-2, weight_decay=0.1),
             "sgd": optax.inject_hyperparams(optax.sgd)(5e-2, momentum=0.9)},
            LAYER_LABELS,
        ),
    ),
    (
        "clip_partition_by_function_in_chain",
        lambda: optim.chain(
            optim.clip_by_global_norm(CLIP),
            optim.partition(
                {"matrix": optim.adamw(optim.warmup_cosine_decay_schedule(**SCHED), weight_decay=0.1),
                 "vector": optim.sgd(1e-2)},
                lambda p: pytree.tree_map(lambda x: "matrix" if x.ndim == 2 else "vector", p),
            ),
        ),
        lambda: optax.chain(
            optax.clip_by_global_norm(CLIP),
            optax.partition(
                {"matrix": optax.inject_hyperparams(optax.adamw)(
                    optax.warmup_cosine_decay_schedule(**SCHED), weight_decay=0.1),
                 "vector": optax.inject_hyperparams(optax.sgd)(1e-2)},
                _by_rank,
            ),
        ),
    ),
    (
        "nadam_by_blocks",  # scale_by_adam(nesterov=True): optax's look-ahead (muon's AdamW group takes it)
        lambda: optim.chain(optim.scale_by_adam(nesterov=True), optim.scale(-1e-2)),
        lambda: optax.chain(optax.scale_by_adam(nesterov=True), optax.scale(-1e-2)),
    ),
    (  # RMSProp by blocks, with the everyday guards: elementwise clip and NaNs to zero. eps 1e-4: RMSProp divides
        # by |g|, and where g is tiny the two frameworks' rsqrt roundings grow (1.4e-6 at eps 1e-6, 4e-7 unclipped)
        "zero_nans_clip_rms_by_blocks",
        lambda: optim.chain(optim.zero_nans(), optim.clip(0.05), optim.scale_by_rms(decay=0.9, eps=1e-4),
                            optim.scale(-1e-2)),
        lambda: optax.chain(optax.zero_nans(), optax.clip(0.05), optax.scale_by_rms(decay=0.9, eps=1e-4),
                            optax.scale(-1e-2)),
    ),
    (
        "rms_bias_corrected_eps_outside",
        lambda: optim.chain(optim.scale_by_rms(0.99, 1e-8, initial_scale=0.1, eps_in_sqrt=False,
                                               bias_correction=True), optim.scale(-1e-3)),
        lambda: optax.chain(optax.scale_by_rms(0.99, 1e-8, initial_scale=0.1, eps_in_sqrt=False,
                                               bias_correction=True), optax.scale(-1e-3)),
    ),
    (
        "adam",
        lambda: optim.adam(1e-2),
        lambda: optax.inject_hyperparams(optax.adam)(1e-2),
    ),
    (
        "sgd_momentum_warmup_cosine",
        lambda: optim.sgd(optim.warmup_cosine_decay_schedule(**SCHED), momentum=0.9),
        lambda: optax.inject_hyperparams(optax.sgd)(
            optax.warmup_cosine_decay_schedule(**SCHED), momentum=0.9
        ),
    ),
    (
        "clip_lion",
        lambda: optim.chain(optim.clip_by_global_norm(CLIP), optim.lion(1e-3, weight_decay=1e-2)),
        lambda: optax.chain(
            optax.clip_by_global_norm(CLIP),
            optax.inject_hyperparams(optax.lion)(1e-3, weight_decay=1e-2),
        ),
    ),
    (
        "adafactor",
        lambda: optim.adafactor(1e-2, min_dim_size_to_factor=4, weight_decay_rate=1e-3),
        lambda: optax.inject_hyperparams(
            optax.adafactor, static_args=("min_dim_size_to_factor", "decay_offset")
        )(1e-2, min_dim_size_to_factor=4, weight_decay_rate=1e-3),
    ),
    (
        "adafactor_momentum_warmup_cosine",
        lambda: optim.adafactor(
            optim.warmup_cosine_decay_schedule(**SCHED), min_dim_size_to_factor=4, momentum=0.9
        ),
        lambda: optax.inject_hyperparams(
            optax.adafactor,
            static_args=("min_dim_size_to_factor", "decay_offset", "dtype_momentum"),
        )(optax.warmup_cosine_decay_schedule(**SCHED), min_dim_size_to_factor=4, momentum=0.9),
    ),
]


def _to_jax(tree):
    return jax.tree.map(lambda t: jnp.asarray(t.numpy()), tree)


def _to_torch(tree):
    return jax.tree.map(lambda a: torch.from_numpy(np.array(a)), tree)


def run_optax(tx, steps):
    params = _to_jax(mlp_params())
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(steps):
        grads = _to_jax(mlp_grad(_to_torch(params)))
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return _to_torch(params)


@pytest.mark.parametrize(
    "ember_tx,optax_tx",
    [c[1:] for c in OPTAX_PARITY_CASES],
    ids=[c[0] for c in OPTAX_PARITY_CASES],
)
def test_matches_optax(ember_tx, optax_tx):
    ours, _ = run_steps(ember_tx(), mlp_params(), mlp_grad, STEPS)
    ref = run_optax(optax_tx(), STEPS)
    assert max_abs_diff(ours, ref) < TOL
    assert max_abs_diff(ours, mlp_params()) > 1e-3  # it moved


SCHEDULE_CASES = [  # (id, ember schedule, optax schedule)
    ("constant", optim.constant_schedule(0.3), lambda: optax.constant_schedule(0.3)),
    (
        "linear",
        optim.linear_schedule(1.0, 0.1, transition_steps=40, transition_begin=10),
        lambda: optax.linear_schedule(1.0, 0.1, transition_steps=40, transition_begin=10),
    ),
    (
        "linear_no_transition",
        optim.linear_schedule(0.7, 0.1, transition_steps=0),
        lambda: optax.linear_schedule(0.7, 0.1, transition_steps=0),
    ),
    (
        "polynomial_power2",
        optim.polynomial_schedule(1.0, 0.01, power=2, transition_steps=60, transition_begin=5),
        lambda: optax.polynomial_schedule(
            1.0, 0.01, power=2, transition_steps=60, transition_begin=5
        ),
    ),
    (
        "cosine_decay",
        optim.cosine_decay_schedule(2.0, decay_steps=70),
        lambda: optax.cosine_decay_schedule(2.0, decay_steps=70),
    ),
    (
        "cosine_decay_alpha_exponent",
        optim.cosine_decay_schedule(1e-3, decay_steps=33, alpha=0.1, exponent=2.0),
        lambda: optax.cosine_decay_schedule(1e-3, decay_steps=33, alpha=0.1, exponent=2.0),
    ),
    (
        "warmup_cosine_decay",
        optim.warmup_cosine_decay_schedule(
            1e-5, 3e-4, warmup_steps=20, decay_steps=100, end_value=3e-5
        ),
        lambda: optax.warmup_cosine_decay_schedule(1e-5, 3e-4, 20, 100, end_value=3e-5),
    ),
    (
        "warmup_cosine_decay_zero_peak",
        optim.warmup_cosine_decay_schedule(0.0, 0.0, warmup_steps=5, decay_steps=10),
        lambda: optax.warmup_cosine_decay_schedule(0.0, 0.0, 5, 10),
    ),
    (
        "join_three",
        optim.join_schedules(
            [
                optim.linear_schedule(0.0, 1.0, 10),
                optim.constant_schedule(1.0),
                optim.cosine_decay_schedule(1.0, 50),
            ],
            [10, 30],
        ),
        lambda: optax.join_schedules(
            [
                optax.linear_schedule(0.0, 1.0, 10),
                optax.constant_schedule(1.0),
                optax.cosine_decay_schedule(1.0, 50),
            ],
            [10, 30],
        ),
    ),
]
SCHEDULE_CASES += [
    ("exponential", optim.exponential_decay(1e-3, 20, 0.5, transition_begin=5),
     lambda: optax.exponential_decay(1e-3, 20, 0.5, transition_begin=5)),
    ("exponential_staircase_floor", optim.exponential_decay(1.0, 7, 0.8, staircase=True, end_value=0.3),
     lambda: optax.exponential_decay(1.0, 7, 0.8, staircase=True, end_value=0.3)),
    ("exponential_growth_ceiling", optim.exponential_decay(0.1, 10, 1.5, end_value=0.5),
     lambda: optax.exponential_decay(0.1, 10, 1.5, end_value=0.5)),
    ("warmup_constant", optim.warmup_constant_schedule(1e-4, 3e-3, warmup_steps=25),
     lambda: optax.warmup_constant_schedule(1e-4, 3e-3, 25)),
    # WSD has no optax name: optax's pieces joined (a linear tail, a cosine tail)
    ("wsd_linear", optim.warmup_stable_decay_schedule(3e-3, 10, 100, 30, end_value=3e-4),
     lambda: optax.join_schedules([optax.linear_schedule(0.0, 3e-3, 10), optax.constant_schedule(3e-3),
                                   optax.linear_schedule(3e-3, 3e-4, 30)], [10, 70])),
    ("wsd_cosine", optim.warmup_stable_decay_schedule(3e-3, 10, 100, 30, end_value=3e-4, decay="cosine"),
     lambda: optax.join_schedules([optax.linear_schedule(0.0, 3e-3, 10), optax.constant_schedule(3e-3),
                                   optax.cosine_decay_schedule(3e-3, 30, alpha=0.1)], [10, 70])),
]
COUNTS = list(range(0, 130)) + [1_000, 123_456_789]


@pytest.mark.parametrize(
    "ours,make_ref", [c[1:] for c in SCHEDULE_CASES], ids=[c[0] for c in SCHEDULE_CASES]
)
def test_schedule_matches_optax(ours, make_ref):
    ref = make_ref()
    got = torch.stack([ours(torch.tensor(c, dtype=torch.int64)) for c in COUNTS])
    want = np.array([np.float32(ref(jnp.asarray(c, dtype=jnp.int32))) for c in COUNTS])
    assert got.dtype == torch.float32
    # Near the end of a cosine, 0.5 * (1 + cos) cancels: one float32 ulp of cos (6e-8) is the
    # honest absolute resolution, relative to the schedule's scale.
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-6, atol=1e-7 * np.abs(want).max())
