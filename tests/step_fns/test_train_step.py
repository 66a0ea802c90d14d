"""Tests for `ember.core.step_fns.train_step`: purity, keys, microbatching, skipping, bf16, compile."""

from __future__ import annotations

import pytest
import torch

from ember import optim
from ember.core import TrainState, random
from ember.core.pytree import tree_map
from ember.core.step_fns import cross_entropy, split_microbatches, train_step
from ember.core.testing import (
    assert_max_compiles,
    assert_pure,
    assert_tree_all_finite,
    assert_tree_dtypes,
    assert_trees_all_close,
    assert_trees_all_equal,
)
from ember.core.tree_math import tree_scale

D_IN, D_HID, N_CLS, BATCH = 8, 16, 4, 8


# ----------------------------------------------------------------------------------- fixtures


def init_mlp(key):
    k1, k2 = random.split(key)
    return {
        "w1": random.normal(k1, (D_IN, D_HID)) * D_IN**-0.5,
        "b1": torch.zeros(D_HID),
        "w2": random.normal(k2, (D_HID, N_CLS)) * D_HID**-0.5,
    }


def mlp_loss(params, batch, *, key, dropout=0.0):
    h = torch.tanh(batch["x"] @ params["w1"] + params["b1"])  # (B, H)
    if key is not None and dropout > 0:
        h = random.dropout(key, h, dropout)
    logits = h @ params["w2"]  # (B, C)
    loss = cross_entropy(logits, batch["y"])
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).float().mean()}


def dropout_loss(params, batch, *, key):
    return mlp_loss(params, batch, key=key, dropout=0.5)


def make_batch(seed, n=BATCH):
    k1, k2 = random.split(random.key(seed))
    return {"x": random.normal(k1, (n, D_IN)), "y": random.randint(k2, (n,), 0, N_CLS)}


def make_state(lr=0.1, tx=None):
    tx = optim.sgd(lr) if tx is None else tx
    return TrainState.create(params=init_mlp(random.key(0)), tx=tx, key=random.key(42))


def clone(tree):
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


# ------------------------------------------------------------------------------------- purity


def test_step_is_pure_and_leaves_inputs_unchanged():
    state, batch = make_state(), make_batch(1)
    before = clone((state, batch))
    new_state, metrics = assert_pure(train_step(dropout_loss), state, batch)
    assert_trees_all_equal((state, batch), before)
    assert int(new_state.step) == 1 and int(state.step) == 0
    assert sorted(metrics) == ["accuracy", "grad_norm", "loss", "lr", "skipped", "update_norm"]
    assert all(v.dim() == 0 for v in metrics.values())
    assert metrics["loss"].dtype == torch.float32


def test_dropout_reproduces_for_same_step_and_differs_across_steps():
    step = train_step(dropout_loss)
    state, batch = make_state(), make_batch(1)
    _, m0 = step(state, batch)
    _, m0_again = step(clone(state), batch)
    _, m1 = step(state.replace(step=state.step + 1), batch)  # same params, next step's key
    assert_trees_all_equal(m0, m0_again)
    assert m0["loss"] != m1["loss"]
    assert not torch.equal(state.key, torch.zeros_like(state.key))


def key_probe_loss(params, batch, *, key):
    loss, _ = mlp_loss(params, batch, key=None)
    return loss, {"key_mod": (key % 1000).to(torch.float32)}


@pytest.mark.parametrize("microbatches", [1, 2, 4], ids=lambda m: f"mb{m}")
def test_loss_fn_gets_documented_keys(microbatches):
    state = make_state().replace(step=torch.tensor(7))
    _, metrics = train_step(key_probe_loss, microbatches=microbatches)(state, make_batch(1))
    step_key = random.fold_in(state.key, state.step)
    if microbatches == 1:
        keys = [step_key]
    else:
        keys = [random.fold_in(step_key, i) for i in range(microbatches)]
    expected = torch.stack([(k % 1000).float() for k in keys]).mean()
    assert_trees_all_close(metrics["key_mod"], expected, rtol=1e-6, atol=1e-4)


# ------------------------------------------------------------------------------- microbatches


@pytest.mark.parametrize("microbatches", [2, 4], ids=lambda m: f"mb{m}")
def test_microbatches_match_full_batch(microbatches):
    state, batch = make_state(), make_batch(3)
    full_state, full = train_step(mlp_loss)(state, batch)
    mb_state, mb = train_step(mlp_loss, microbatches=microbatches)(state, batch)
    # Same math summed in a different order: float32 rounding only.
    assert_trees_all_close(mb_state.params, full_state.params, rtol=1e-6, atol=1e-6)
    assert_trees_all_close(mb, full, rtol=1e-5, atol=1e-6)


SPLIT_ERRORS = [
    ("not_divisible", {"x": torch.zeros(6, 2)}, 4, r"batch\.x \(leading dim 6.*6 % 4 = 2.*\[1, 2, 3, 6\]"),
    ("scalar_leaf", {"x": torch.zeros(4, 2), "w": torch.tensor(1.0)}, 2, r"batch\.w.*0-d"),
    ("nested_path", {"a": [torch.zeros(4), torch.zeros(5)]}, 2, r"batch\.a\.1 \(leading dim 5"),
]


@pytest.mark.parametrize("name,batch,m,match", SPLIT_ERRORS, ids=[c[0] for c in SPLIT_ERRORS])
def test_microbatch_split_errors_name_the_leaf(name, batch, m, match):
    with pytest.raises(ValueError, match=match):
        split_microbatches(batch, m)


def test_split_microbatches_views_and_passthrough():
    batch = {"x": torch.arange(8).reshape(4, 2), "flag": "train"}
    chunks = split_microbatches(batch, 2)
    assert [c["x"].tolist() for c in chunks] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert all(c["flag"] == "train" for c in chunks)


def test_train_step_microbatch_error_at_call():
    step = train_step(mlp_loss, microbatches=3)
    with pytest.raises(ValueError, match=r"batch\.x .*8 % 3 = 2"):
        step(make_state(), make_batch(1))


# ----------------------------------------------------------------------------- non-finite skips

NONFINITE = [("nan", float("nan")), ("inf", float("inf"))]


@pytest.mark.parametrize("name,bad", NONFINITE, ids=[c[0] for c in NONFINITE])
def test_nonfinite_step_is_skipped_then_training_resumes(name, bad):
    step = train_step(mlp_loss)
    state = make_state()
    batch = make_batch(1)
    bad_batch = {"x": batch["x"].clone(), "y": batch["y"]}
    bad_batch["x"][0, 0] = bad

    skipped_state, m = step(state, bad_batch)
    assert_trees_all_equal(skipped_state.params, state.params)
    assert_trees_all_equal(skipped_state.opt_state, state.opt_state)
    assert int(skipped_state.step) == 1
    assert int(skipped_state.skipped_steps) == 1
    assert m["skipped"].item() == 1.0 and m["skipped"].dtype == torch.float32
    assert m["update_norm"].item() == 0.0

    next_state, m2 = step(skipped_state, batch)
    assert int(next_state.step) == 2 and int(next_state.skipped_steps) == 1
    assert m2["skipped"].item() == 0.0
    assert not torch.equal(next_state.params["w1"], state.params["w1"])
    assert_tree_all_finite(next_state.params)


def test_skip_nonfinite_false_applies_the_bad_update():
    batch = make_batch(1)
    batch["x"][0, 0] = float("nan")
    new_state, m = train_step(mlp_loss, skip_nonfinite=False)(make_state(), batch)
    assert torch.isnan(new_state.params["w1"]).any()
    assert m["skipped"].item() == 0.0 and int(new_state.skipped_steps) == 0


# ----------------------------------------------------------------------------- mixed precision


def dtype_probe_loss(params, batch, *, key):
    loss, aux = mlp_loss(params, batch, key=key)
    aux["saw_bf16"] = torch.tensor(float(params["w1"].dtype == torch.bfloat16))
    return loss, aux


def test_compute_dtype_bf16_keeps_fp32_master_params():
    state, batch = make_state(), make_batch(5)
    ref_state, ref = train_step(dtype_probe_loss)(state, batch)
    bf_state, bf = train_step(dtype_probe_loss, compute_dtype=torch.bfloat16)(state, batch)
    assert bf["saw_bf16"].item() == 1.0 and ref["saw_bf16"].item() == 0.0
    assert_tree_dtypes(bf_state.params, torch.float32)
    assert bf["loss"].dtype == torch.float32
    assert_tree_all_finite((bf_state.params, bf))
    # bf16 keeps 8 mantissa bits: relative error ~ 2**-8 per op, a few ops deep.
    assert_trees_all_close(bf["loss"], ref["loss"], rtol=3e-2, atol=1e-2)
    assert_trees_all_close(bf["grad_norm"], ref["grad_norm"], rtol=5e-2, atol=1e-2)


# ------------------------------------------------------------------------------------- metrics


class FixedSgd:
    """SGD with a Python-float step size that passes its state through untouched."""

    def __init__(self, step_size):
        self.step_size = step_size

    def init(self, params):
        return ()

    def update(self, grads, state, params=None):
        return tree_scale(grads, -self.step_size), state


def test_lr_metric_reads_opt_state_and_is_absent_without_hyperparams():
    _, m = train_step(mlp_loss)(make_state(lr=0.25), make_batch(1))
    assert m["lr"].item() == 0.25 and m["lr"].dtype == torch.float32
    state = TrainState.create(params=init_mlp(random.key(0)), tx=FixedSgd(0.1))
    _, m = train_step(mlp_loss)(state, make_batch(1))
    assert "lr" not in m


def test_tx_argument_overrides_state_tx_and_norms_are_consistent():
    state, batch = make_state(lr=0.1), make_batch(2)
    _, m = train_step(mlp_loss, FixedSgd(0.5))(state, batch)
    # The update is -0.5 * grad (the argument's tx), so update_norm = 0.5 * grad_norm; lr is still
    # read from the state's opt_state, which FixedSgd passes through.
    assert_trees_all_close(m["update_norm"], 0.5 * m["grad_norm"], rtol=1e-6)
    assert m["lr"].item() == pytest.approx(0.1)


# ----------------------------------------------------------------------------------- bad input


def vector_loss(params, batch, *, key):
    return (batch["x"] @ params["w1"]).mean(-1)


def list_loss(params, batch, *, key):
    return [mlp_loss(params, batch, key=key)[0]]


def vector_aux_loss(params, batch, *, key):
    loss, _ = mlp_loss(params, batch, key=key)
    return loss, {"per_example": batch["x"].sum(-1)}


def shadowing_aux_loss(params, batch, *, key):
    loss, _ = mlp_loss(params, batch, key=key)
    return loss, {"grad_norm": loss}


CALL_ERRORS = [
    ("dict_state", mlp_loss, lambda s: s.params, TypeError, r"TrainState\.create"),
    ("tensor_state", mlp_loss, lambda s: torch.zeros(3), TypeError, r"params.*opt_state.*step"),
    ("vector_loss", vector_loss, lambda s: s, ValueError, r"0-d \(scalar\) loss tensor; the loss has shape \(8,\)"),
    ("list_loss", list_loss, lambda s: s, TypeError, r"0-d loss tensor, a `TokenLoss.*or a tuple"),
    ("vector_aux", vector_aux_loss, lambda s: s, ValueError, r"'per_example' must be a 0-d"),
    ("shadowing_aux", shadowing_aux_loss, lambda s: s, ValueError, r"'grad_norm' collides"),
    ("no_tx", mlp_loss, lambda s: s.replace(tx=None), TypeError, r"no gradient transformation"),
]


@pytest.mark.parametrize(
    "name,loss_fn,make,exc,match", CALL_ERRORS, ids=[c[0] for c in CALL_ERRORS]
)
def test_bad_call_inputs_raise_with_fix(name, loss_fn, make, exc, match):
    step = train_step(loss_fn)
    with pytest.raises(exc, match=match):
        step(make(make_state()), make_batch(1))


BUILD_ERRORS = [
    ("microbatches_zero", dict(microbatches=0), ValueError, r"microbatches.*>= 1.*got 0"),
    ("microbatches_negative", dict(microbatches=-2), ValueError, r"got -2"),
    ("microbatches_str", dict(microbatches="2"), TypeError, r"int >= 1"),
    ("compute_dtype_int", dict(compute_dtype=torch.int32), TypeError, r"floating torch\.dtype"),
    ("compute_dtype_str", dict(compute_dtype="bf16"), TypeError, r"compute_dtype"),
    ("tx_without_update", dict(tx=object()), TypeError, r"update\(grads, opt_state, params\)"),
]


@pytest.mark.parametrize("name,kwargs,exc,match", BUILD_ERRORS, ids=[c[0] for c in BUILD_ERRORS])
def test_bad_build_arguments_raise(name, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        train_step(mlp_loss, **kwargs)


def test_loss_fn_must_be_callable():
    with pytest.raises(TypeError, match=r"callable `loss_fn\(params, batch, \*, key\)`"):
        train_step("mlp_loss")


# ------------------------------------------------------------------------------------- compile

COMPILED_MICROBATCHES = 2


@pytest.fixture(scope="module")
def compiled_run():
    """One fullgraph-compiled step (dropout, microbatches, skip logic), shared by the tests."""
    step = train_step(dropout_loss, microbatches=COMPILED_MICROBATCHES)
    compiled = assert_max_compiles(torch.compile(step, fullgraph=True), n=1)
    return step, compiled


def test_train_step_traces_into_one_graph(assert_single_graph):
    step = train_step(dropout_loss, microbatches=COMPILED_MICROBATCHES)
    state, batch = adamw_state(), make_batch(1)
    _, metrics = assert_single_graph(step, state, batch)
    assert_trees_all_close(metrics, step(state, batch)[1], rtol=1e-6, atol=1e-7)


def adamw_state():
    return make_state(tx=optim.adamw(1e-2, weight_decay=0.1))


def test_compiled_step_matches_eager_and_compiles_once(compiled_run):
    step, compiled = compiled_run
    eager_state = compiled_state = adamw_state()
    batches = [make_batch(s) for s in range(3)]
    nan_batch = clone(batches[0])
    nan_batch["x"][1, 2] = float("nan")
    for batch in batches + [nan_batch]:
        eager_state, eager_m = step(eager_state, batch)
        compiled_state, compiled_m = compiled(compiled_state, batch)
        # Inductor fuses and reorders float32 reductions: rounding-level differences only.
        assert_trees_all_close(compiled_m, eager_m, rtol=1e-5, atol=1e-6)
    assert_trees_all_close(compiled_state, eager_state, rtol=1e-5, atol=1e-6)
    assert int(compiled_state.skipped_steps) == 1 and int(compiled_state.step) == 4
    assert compiled.compiles == 1


def test_compiled_step_lr_change_does_not_recompile(compiled_run):
    _, compiled = compiled_run
    state = adamw_state()
    state = state.replace(opt_state=optim.set_hyperparams(state.opt_state, learning_rate=0.05))
    _, m = compiled(state, make_batch(9))
    assert m["lr"].item() == pytest.approx(0.05)
