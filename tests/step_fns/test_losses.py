"""Tests for `ember.core.step_fns.cross_entropy` against torch.nn.functional and the z-loss formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.core import random
from ember.core.step_fns import cross_entropy
from ember.core.testing import assert_trees_all_close, check_grads

V = 11

# (name, label shape, logits dtype, fraction of ignored labels, ignore_index)
CASES = [
    ("2d_fp32", (6,), torch.float32, 0.0, -100),
    ("3d_fp32_ignored", (3, 5), torch.float32, 0.3, -100),
    ("3d_bf16_ignored", (3, 5), torch.bfloat16, 0.3, -100),
    ("custom_ignore", (4, 4), torch.float32, 0.5, 0),
    ("4d_fp64", (2, 3, 2), torch.float64, 0.2, -1),
]


def make(labels_shape, dtype, ignore_frac, ignore_index, seed=0):
    k1, k2, k3 = random.split(random.key(seed), 3)
    logits = (random.normal(k1, (*labels_shape, V)) * 3).to(dtype)
    labels = random.randint(k2, labels_shape, 1, V)
    ignored = random.uniform(k3, labels_shape) < ignore_frac
    return logits, torch.where(ignored, torch.full_like(labels, ignore_index), labels)


def reference(logits, labels, ignore_index, reduction):
    return F.cross_entropy(
        logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=ignore_index,
        reduction=reduction,
    )


@pytest.mark.parametrize("name,shape,dtype,frac,ignore", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_cross_entropy(name, shape, dtype, frac, ignore, reduction):
    logits, labels = make(shape, dtype, frac, ignore)
    got = cross_entropy(logits, labels, ignore_index=ignore, reduction=reduction)
    want = reference(logits, labels, ignore, reduction)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.shape == (labels.shape if reduction == "none" else ())
    assert_trees_all_close(got.reshape(-1) if reduction == "none" else got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,shape,dtype,frac,ignore", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_gradient_matches_torch(name, shape, dtype, frac, ignore):
    logits, labels = make(shape, torch.float32, frac, ignore)
    got = torch.func.grad(lambda x: cross_entropy(x, labels, ignore_index=ignore))(logits)
    want = torch.func.grad(lambda x: reference(x, labels, ignore, "mean"))(logits)
    assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("z_loss", [1e-4, 0.1])
def test_z_loss_formula(z_loss):
    logits, labels = make((4, 6), torch.float32, 0.25, -100, seed=3)
    loss, aux = cross_entropy(logits, labels, z_loss=z_loss, return_aux=True)
    valid = labels != -100
    lse = torch.logsumexp(logits, dim=-1)
    z_expected = z_loss * (lse[valid] ** 2).mean()  # PaLM sec. 5: z_loss * log(Z)^2
    ce_expected = reference(logits, labels, -100, "mean")
    assert_trees_all_close(aux["z_loss"], z_expected, rtol=1e-6, atol=1e-7)
    assert_trees_all_close(aux["ce_loss"], ce_expected, rtol=1e-5, atol=1e-6)
    assert_trees_all_close(loss, ce_expected + z_expected, rtol=1e-5, atol=1e-6)
    assert int(aux["num_tokens"]) == int(valid.sum())


def test_z_loss_gradient_against_finite_differences():
    logits, labels = make((2, 3), torch.float64, 0.3, -100, seed=4)
    check_grads(lambda x: cross_entropy(x, labels, z_loss=0.5), (logits,))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_gives_zero_not_nan(reduction):
    logits = torch.randn(3, 4, V)
    labels = torch.full((3, 4), -100)
    loss, aux = cross_entropy(logits, labels, z_loss=1e-3, reduction=reduction, return_aux=True)
    assert loss.item() == 0.0 and aux["z_loss"].item() == 0.0 and int(aux["num_tokens"]) == 0
    grads = torch.func.grad(lambda x: cross_entropy(x, labels, z_loss=1e-3))(logits)
    assert torch.equal(grads, torch.zeros_like(grads))


def test_aux_without_z_loss_and_tensor_weight():
    logits, labels = make((5,), torch.float32, 0.0, -100)
    _, aux = cross_entropy(logits, labels, return_aux=True)
    assert sorted(aux) == ["ce_loss", "num_tokens", "z_loss"] and aux["z_loss"].item() == 0.0
    as_tensor = cross_entropy(logits, labels, z_loss=torch.tensor(0.1))
    as_float = cross_entropy(logits, labels, z_loss=0.1)
    assert_trees_all_close(as_tensor, as_float)


def test_traces_whole_without_graph_breaks(assert_single_graph):
    logits, labels = make((3, 5), torch.float32, 0.3, -100)
    out = assert_single_graph(lambda x, y: cross_entropy(x, y, z_loss=1e-4), logits, labels)
    assert_trees_all_close(out, cross_entropy(logits, labels, z_loss=1e-4))


ERRORS = [
    ("float_labels", torch.randn(4, V), torch.zeros(4), TypeError, r"integer tensor of class indices"),
    ("int_logits", torch.zeros(4, V, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), TypeError,
     r"floating-point tensor"),
    ("shape_mismatch", torch.randn(4, V), torch.zeros(5, dtype=torch.int64), ValueError,
     r"labels\.shape \+ \(V,\); got logits \(4, 11\) and labels \(5,\)"),
    ("class_dim_not_last", torch.randn(2, V, 3), torch.zeros(2, 3, dtype=torch.int64), ValueError,
     r"transpose"),
]


@pytest.mark.parametrize("name,logits,labels,exc,match", ERRORS, ids=[c[0] for c in ERRORS])
def test_bad_inputs(name, logits, labels, exc, match):
    with pytest.raises(exc, match=match):
        cross_entropy(logits, labels)


def test_bad_reduction_lists_choices():
    with pytest.raises(ValueError, match=r"\['mean', 'sum', 'none', 'sum_and_count'\], got 'avg'"):
        cross_entropy(torch.randn(2, V), torch.zeros(2, dtype=torch.int64), reduction="avg")
