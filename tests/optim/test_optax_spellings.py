"""optax's spellings in ember.optim: apply_if_finite, MultiSteps / every_k_schedule, global_norm, and
optax objects passed by mistake (named, with ember's spelling, in one line)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ember import optim
from ember.core import TrainState, pytree
from ember.core.step_fns import train_step

jax = pytest.importorskip("jax", reason="optax parity needs jax (pip install -e .[test])")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax", reason="optax parity needs optax (pip install -e .[test])")

TOL = 1e-6  # float32 rounding of the same math, a dozen steps


def _to_jax(tree):
    return jax.tree.map(lambda t: jnp.asarray(t.numpy()), tree)


def _by_path(ref):
    """optax's updates as `{dotted path: numpy array}` (JAX sorts dict keys, torch keeps their order)."""
    return {".".join(str(k.key) for k in path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(ref)}


def _params():
    return {"w": torch.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": torch.tensor([0.5, -0.25, 1.0])}


def _poisoned_grads(call, poison):
    """Gradients that change every call; NaN or Inf in one element where `poison` says."""
    g = pytree.tree_map(lambda t: torch.cos(t * (call + 1)), _params())
    if call in poison:
        g["b"][1] = poison[call]
    return g


def _compare(ember_tx, optax_tx, calls, poison=None, extra=None):
    """Run both over the same gradients; compare every call's updates, then return both last states."""
    poison = poison or {}
    params = _params()
    state, ref_state = ember_tx.init(params), optax_tx.init(_to_jax(params))
    ref_update = jax.jit(optax_tx.update)  # one compile instead of eager lax.cond every call
    for call in range(calls):
        grads = _poisoned_grads(call, poison)
        updates, state = ember_tx.update(grads, state, params)
        ref_updates, ref_state = ref_update(_to_jax(grads), ref_state, _to_jax(params))
        ref = _by_path(ref_updates)
        assert sorted(ref) == sorted(pytree.tree_paths(updates))
        for path, ours in pytree.tree_leaves_with_path(updates):
            np.testing.assert_allclose(ours.numpy(), ref[path], atol=TOL, rtol=0, equal_nan=True, err_msg=f"call {call}")
        if extra is not None:
            extra(call, state, ref_state)
    return state, ref_state


def test_apply_if_finite_matches_optax():
    nan, inf = float("nan"), float("inf")
    # finite, skipped, finite, skipped twice, then the third in a row is applied (NaN updates).
    poison = {1: nan, 3: inf, 4: nan, 5: -inf}
    seen = []

    def counters(call, state, ref):
        got = (int(state.notfinite_count), bool(state.last_finite), int(state.total_notfinite))
        assert got == (int(ref.notfinite_count), bool(ref.last_finite), int(ref.total_notfinite)), call
        seen.append(got)

    _compare(optim.apply_if_finite(optim.sgd(0.1, momentum=0.9), 2),
             optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), 2), calls=6, poison=poison, extra=counters)
    assert seen == [(0, True, 0), (1, False, 1), (0, True, 1), (1, False, 2), (2, False, 3), (3, False, 4)]


MULTI_STEPS_CASES = [  # (id, ember transformation, optax transformation)
    ("every_k_3", lambda: optim.MultiSteps(optim.adam(1e-2), every_k_schedule=3),  # optax's positional order
     lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3)),
    ("growing_schedule", lambda: optim.MultiSteps(optim.adam(1e-2), lambda step: torch.where(step < 2, 2, 3)),
     lambda: optax.MultiSteps(optax.adam(1e-2), lambda step: jnp.where(step < 2, 2, 3))),
    ("summed", lambda: optim.multi_steps(optim.sgd(0.1, momentum=0.9), every_k_schedule=2, use_grad_mean=False),
     lambda: optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2, use_grad_mean=False)),
]


@pytest.mark.parametrize("ours,ref", [c[1:] for c in MULTI_STEPS_CASES], ids=[c[0] for c in MULTI_STEPS_CASES])
def test_multi_steps_spellings_match_optax(ours, ref):
    ember_tx, optax_tx = ours(), ref()

    def steps(call, state, ref_state):
        assert (int(state.mini_step), int(state.gradient_step)) == (
            int(ref_state.mini_step), int(ref_state.gradient_step)), call
        if isinstance(ember_tx, optim.MultiSteps):
            assert bool(ember_tx.has_updated(state)) == bool(optax_tx.has_updated(ref_state)), call

    state, _ = _compare(ember_tx, optax_tx, calls=10, extra=steps)
    assert int(state.gradient_step) >= 3  # the inner optimizer ran


def test_multi_steps_class_is_a_transformation():
    tx = optim.MultiSteps(optim.sgd(1.0), 2)
    assert tx.gradient_transformation().init is tx.init
    state = TrainState.create(params={"w": torch.zeros(2)}, tx=tx)  # accepted where a transformation goes
    assert int(state.opt_state.mini_step) == 0


def test_global_norm_matches_optax():
    grads = _poisoned_grads(0, {})
    np.testing.assert_allclose(optim.global_norm(grads).numpy(), np.asarray(optax.global_norm(_to_jax(grads))),
                               rtol=1e-6)


def test_new_transformations_trace_whole():
    """No host sync: Dynamo traces each update in one graph, with the eager numbers."""
    params = {"w": torch.ones(3)}
    for tx in (optim.apply_if_finite(optim.sgd(0.1, momentum=0.9), 1),
               optim.MultiSteps(optim.sgd(0.1, momentum=0.9), lambda step: torch.where(step < 1, 1, 2))):
        state = tx.init(params)
        grads = {"w": torch.tensor([1.0, float("nan"), 2.0])}
        want = tx.update(grads, state, params)
        got = torch.compile(tx.update, backend="eager", fullgraph=True)(grads, state, params)
        for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
            torch.testing.assert_close(a, b, equal_nan=True)


def _loss(params, batch, *, key=None):
    return (params["w"] ** 2).sum()


OPTAX_OBJECT_CASES = [  # (id, call with an optax object, where, optax name, ember's spelling)
    ("chain", lambda: optim.chain(optax.adam(1e-3)), "chain(...) argument 0", "adam", "ember.optim.adam"),
    ("chain_second", lambda: optim.chain(optim.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1)),
     "chain(...) argument 1", "adamw", "ember.optim.adamw"),
    ("masked", lambda: optim.masked(optax.sgd(0.1, momentum=0.9), optim.decay_mask), "masked(inner=...)", "sgd",
     "ember.optim.sgd"),
    ("multi_steps", lambda: optim.multi_steps(optax.lion(1e-4), 2), "multi_steps(inner=...)", "lion",
     "ember.optim.lion"),
    ("MultiSteps", lambda: optim.MultiSteps(optax.adafactor(1e-2), every_k_schedule=2), "MultiSteps(opt=...)",
     "adafactor", "ember.optim.adafactor"),
    ("apply_if_finite", lambda: optim.apply_if_finite(optax.clip_by_global_norm(1.0), 3),
     "apply_if_finite(inner=...)", "clip_by_global_norm", "ember.optim.clip_by_global_norm"),
    ("inject_hyperparams", lambda: optim.chain(optax.inject_hyperparams(optax.adamw)(1e-3)),
     "chain(...) argument 0", "adamw", "ember.optim.adamw"),
    ("optax_MultiSteps", lambda: optim.chain(optax.MultiSteps(optax.adam(1e-3), 2)), "chain(...) argument 0",
     "MultiSteps", "ember.optim.MultiSteps"),
    ("optax_chain", lambda: optim.chain(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))),
     "chain(...) argument 0", "chain", "ember.optim.chain"),
    ("train_state", lambda: TrainState.create(params={"w": torch.zeros(2)}, tx=optax.adam(1e-3)),
     "TrainState.create(tx=...)", "adam", "ember.optim.adam"),
    ("train_step", lambda: train_step(_loss, optax.apply_if_finite(optax.adam(1e-3), 2)), "train_step(tx=...)",
     "apply_if_finite", "ember.optim.apply_if_finite"),
]


@pytest.mark.parametrize("make,where,name,ours", [c[1:] for c in OPTAX_OBJECT_CASES],
                         ids=[c[0] for c in OPTAX_OBJECT_CASES])
def test_optax_object_is_named_with_embers_spelling(make, where, name, ours):
    want = (f"{where} got an optax GradientTransformation (optax.{name}), which works on JAX arrays; "
            f"use {ours} (same name and arguments, on torch tensors).")
    with pytest.raises(TypeError, match=f"^{re.escape(want)}$"):
        make()


def test_optax_object_without_an_ember_twin():
    want = ("chain(...) argument 0 got an optax GradientTransformation (optax.scale_by_rss), which works on JAX "
            "arrays; build it from ember.optim's transformations, which run on torch tensors.")
    with pytest.raises(TypeError, match=f"^{re.escape(want)}$"):
        optim.chain(optax.scale_by_rss())


SPELLING_ERRORS = [  # (id, call, exception, exact message)
    ("both_every_k_spellings", lambda: optim.multi_steps(optim.sgd(0.1), 2, every_k_schedule=2), ValueError,
     "multi_steps(...) got both every_k=2 and every_k_schedule=2, which are one argument (every_k_schedule is "
     "optax's name); pass only one."),
    ("no_every_k", lambda: optim.multi_steps(optim.sgd(0.1)), TypeError,
     "multi_steps(...) needs the number of calls per update: every_k=4 (or optax's every_k_schedule=4)."),
    ("should_skip_update_fn", lambda: optim.MultiSteps(optim.sgd(0.1), 2, should_skip_update_fn=lambda *a: None),
     TypeError, "MultiSteps(should_skip_update_fn=...) is not supported in ember; to skip updates with non-finite "
     "gradients wrap the optimizer: MultiSteps(optim.apply_if_finite(opt, max_consecutive_errors), every_k_schedule=k)."),
    ("apply_if_finite_negative", lambda: optim.apply_if_finite(optim.sgd(0.1), -1), ValueError,
     "apply_if_finite(max_consecutive_errors=...) must be >= 0, got -1."),
    ("apply_if_finite_float", lambda: optim.apply_if_finite(optim.sgd(0.1), 2.0), TypeError,
     "apply_if_finite(max_consecutive_errors=...) expects an int, got float 2.0."),
]


@pytest.mark.parametrize("call,exc,message", [c[1:] for c in SPELLING_ERRORS], ids=[c[0] for c in SPELLING_ERRORS])
def test_spelling_errors_are_one_line(call, exc, message):
    with pytest.raises(exc, match=f"^{re.escape(message)}$"):
        call()
