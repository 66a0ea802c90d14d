"""`optim.muon` equals `optax.contrib.muon` (float32, 50 steps, matrices tall, wide, square and a 3-D stack, with a
vector on AdamW) and `torch.optim.Muon` where they agree (no Nesterov: torch's look-ahead is not bias-corrected;
its bf16 iteration against ember's `ns_dtype=torch.bfloat16`, the same operations: bitwise on one matrix); bad leaves
get one line naming the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember import optim
from ember.core import pytree

jax = pytest.importorskip("jax", reason="optax parity needs jax (pip install -e .[test])")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax", reason="optax parity needs optax (pip install -e .[test])")

STEPS = 50
SHAPES = {"tall": (24, 8), "wide": (6, 20), "square": (12, 12), "stack": (3, 10, 6), "bias": (12,)}  # (out, in)
LABELS = {k: "adam" if len(s) == 1 else "muon" for k, s in SHAPES.items()}


def _params():
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(*s, generator=g) * 0.3 for k, s in SHAPES.items()}


_G = torch.Generator().manual_seed(1)
_X = {k: torch.randn(s[-1], 32, generator=_G) for k, s in SHAPES.items() if len(s) > 1}
_T = {k: torch.randn(*s[:-1], 32, generator=_G) for k, s in SHAPES.items() if len(s) > 1}


def loss(params):
    total = ((params["bias"] - 0.5) ** 2).sum()
    for k, x in _X.items():
        total = total + ((torch.tanh(params[k] @ x) - _T[k]) ** 2).mean()
    return total


def _ember(tx, steps=STEPS):
    params, state = _params(), None
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(torch.func.grad(loss)(params), state, params)
        params = optim.apply_updates(params, updates)
    return params


def _to_optax_layout(t):  # optax's matrices are (in, out)
    return t if t.dim() == 1 else t.transpose(-1, -2)


def _optax(tx, steps=STEPS):
    params = {k: jnp.asarray(_to_optax_layout(v).numpy()) for k, v in _params().items()}
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(steps):
        torch_params = {k: _to_optax_layout(torch.from_numpy(np.array(v))) for k, v in params.items()}
        grads = {k: jnp.asarray(_to_optax_layout(g).numpy()) for k, g in torch.func.grad(loss)(torch_params).items()}
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return {k: _to_optax_layout(torch.from_numpy(np.array(v))) for k, v in params.items()}


OPTAX_DIMS = {k: None if len(s) == 1 else optax.contrib.MuonDimensionNumbers(len(s) - 2, len(s) - 1)
              for k, s in SHAPES.items()}


@pytest.mark.parametrize("nesterov,weight_decay,consistent_rms", [
    (True, 0.0, None), (False, 0.1, None), (True, 0.1, 0.2), (False, 0.0, 0.2)])
def test_muon_matches_optax(nesterov, weight_decay, consistent_rms):
    ours = _ember(optim.muon(2e-2, weight_decay=weight_decay, nesterov=nesterov, consistent_rms=consistent_rms,
                             adam_weight_decay=0.01, param_labels=LABELS))
    ref = _optax(optax.contrib.muon(2e-2, weight_decay=weight_decay, nesterov=nesterov, consistent_rms=consistent_rms,
                                    adam_weight_decay=0.01, muon_weight_dimension_numbers=OPTAX_DIMS))
    for k in SHAPES:
        assert (ours[k] - ref[k]).abs().max() < 1e-5, k
        assert (ours[k] - _params()[k]).abs().max() > 1e-2, k  # it moved


@pytest.mark.parametrize("adjust_lr_fn,consistent_rms", [("original", None), ("match_rms_adamw", 0.2)])
def test_muon_matches_torch_where_they_agree(adjust_lr_fn, consistent_rms):
    names = ["tall", "wide", "square"]  # torch.optim.Muon takes 2-D parameters only
    labels = {k: "muon" if k in names else "adam" for k in SHAPES}
    ours = _ember(optim.muon(2e-2, weight_decay=0.1, nesterov=False, consistent_rms=consistent_rms,
                             ns_dtype=torch.bfloat16, param_labels=labels), steps=5)
    params = _params()
    leaves = [params[k].requires_grad_() for k in names]
    opt = torch.optim.Muon(leaves, lr=2e-2, weight_decay=0.1, momentum=0.95, nesterov=False, eps=1e-8,
                           adjust_lr_fn=adjust_lr_fn)
    for _ in range(5):
        opt.zero_grad()
        loss({**params, "stack": params["stack"].detach(), "bias": params["bias"].detach()}).backward()
        opt.step()
    for k in names:
        moved = (params[k] - _params()[k]).abs().max()
        # bf16's precision: torch orthogonalises `0.05 * g`, ember (optax's bias correction) `g`, which bf16 rounds
        # differently, and five quintic steps amplify it (measured 3-5% of a step's move; float32 against torch 3%)
        assert (ours[k] - params[k].detach()).abs().max() < 0.06 * moved, k


def test_newton_schulz_in_bf16_against_float32():
    x = torch.randn(3, 64, 32, generator=torch.Generator().manual_seed(2))
    full = optim.orthogonalize_via_newton_schulz(x)
    half = optim.orthogonalize_via_newton_schulz(x, dtype=torch.bfloat16)
    assert half.dtype == torch.float32
    rel = float((half - full).norm() / full.norm())
    assert 1e-4 < rel < 2e-2  # bf16's rounding, not a different result


@pytest.mark.parametrize("shape", [(4, 10, 6), (2, 3, 6, 10)], ids=["layers", "layers_experts"])
def test_a_stack_is_orthogonalised_matrix_by_matrix(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    whole = optim.orthogonalize_via_newton_schulz(x).reshape(-1, *shape[-2:])
    for i, matrix in enumerate(x.reshape(-1, *shape[-2:])):
        torch.testing.assert_close(whole[i], optim.orthogonalize_via_newton_schulz(matrix))


def test_muon_labels_from_a_models_axes():
    axes = {"wte": {"weight": ("vocab", "embed")}, "ln": {"weight": ("layers", "embed")},
            "wq": {"weight": ("layers", "heads", "embed")}, "gate": ("layers", "expert", "mlp", "embed"),
            "router": {"weight": ("layers", None, "embed")}, "ln_f": {"weight": ("embed",)}}
    assert optim.muon_labels(axes) == {"wte": {"weight": "adam"}, "ln": {"weight": "adam"},
                                       "wq": {"weight": "muon"}, "gate": "muon", "router": {"weight": "muon"},
                                       "ln_f": {"weight": "adam"}}


def test_a_vector_labelled_muon_is_one_line_naming_the_fix():
    tx = optim.muon(1e-2, param_labels=pytree.tree_map(lambda _: "muon", SHAPES, is_leaf=lambda x: isinstance(x, tuple)))
    params = _params()
    with pytest.raises(ValueError, match=r"muon orthogonalises matrices, but got a 1-D leaf of shape \(12,\).*'adam'"):
        tx.update(torch.func.grad(loss)(params), tx.init(params), params)


def test_the_bf16_iteration_is_torchs_bit_for_bit():
    from torch.optim._muon import _zeropower_via_newtonschulz  # the reference's own function, read in a test

    g = torch.randn(24, 8, generator=torch.Generator().manual_seed(4))
    ours = optim.orthogonalize_via_newton_schulz(g, dtype=torch.bfloat16)
    assert torch.equal(ours, _zeropower_via_newtonschulz(g, (3.4445, -4.775, 2.0315), 5, 1e-8).float())


def test_the_muon_step_compiles_once_repeats_its_bits_and_takes_a_new_rate_without_recompiling():
    from ember.core import TrainState, jit
    from ember.core.step_fns import train_step
    from ember.core.testing import assert_max_compiles

    tx = optim.muon(2e-2, weight_decay=0.1, param_labels=LABELS, adam_learning_rate=1e-2)
    step = assert_max_compiles(jit(train_step(lambda p, batch, key=None: loss(p)), backend="inductor"), n=1)
    state = TrainState.create(params=_params(), tx=tx)
    first, metrics = step(state, {})
    again, _ = step(state, {})
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(first), pytree.tree_leaves(again)))
    eager, _ = train_step(lambda p, batch, key=None: loss(p))(state, {})
    for k in SHAPES:
        torch.testing.assert_close(first.params[k], eager.params[k], rtol=1e-5, atol=1e-6)
    assert float(metrics["lr"]) == pytest.approx(2e-2) and float(metrics["lr/adam"]) == pytest.approx(1e-2)
    slower = first.replace(opt_state=optim.set_hyperparams(first.opt_state, learning_rate=1e-3))
    _, metrics = step(slower, {})
    assert float(metrics["lr"]) == pytest.approx(1e-3)
