"""Tests for ember.core.tree_math."""

import math

import pytest
import torch

from ember.core import tree_math as tm

A = {"w": torch.tensor([3.0, 4.0]), "b": [torch.tensor(1.0)]}
B = {"w": torch.tensor([1.0, 1.0]), "b": [torch.tensor(2.0)]}


def test_add_sub_scale():
    assert tm.tree_add(A, B)["w"].tolist() == [4.0, 5.0]
    assert tm.tree_sub(A, B)["b"][0].item() == -1.0
    assert tm.tree_scale(A, 2.0)["w"].tolist() == [6.0, 8.0]
    assert tm.tree_scale(A, torch.tensor(0.5))["w"].tolist() == [1.5, 2.0]


def test_apply_updates_keeps_param_dtype():
    params = {"w": torch.ones(2, dtype=torch.bfloat16)}
    out = tm.apply_updates(params, {"w": torch.full((2,), 0.5)})
    assert out["w"].dtype == torch.bfloat16 and out["w"].tolist() == [1.5, 1.5]


def test_global_norm_and_vdot():
    assert math.isclose(tm.global_norm(A).item(), math.sqrt(9 + 16 + 1), rel_tol=1e-6)
    assert tm.tree_vdot(A, B).item() == 3 + 4 + 2


def test_all_finite_and_where():
    assert tm.tree_all_finite(A).item()
    bad = {"w": torch.tensor([1.0, float("nan")]), "b": [torch.tensor(1.0)]}
    assert not tm.tree_all_finite(bad).item()
    assert not tm.tree_all_finite({"x": torch.tensor([float("inf")])}).item()
    picked = tm.tree_where(torch.tensor(False), A, B)
    assert picked["w"].tolist() == [1.0, 1.0]


def test_sizes_and_cast():
    assert tm.tree_size(A) == 3 and tm.tree_bytes(A) == 12
    assert tm.tree_cast({"i": torch.ones(1, dtype=torch.int64), "f": torch.ones(1)}, torch.bfloat16)["i"].dtype == torch.int64


def test_structure_mismatch_is_named():
    with pytest.raises(ValueError, match="differ in structure"):
        tm.tree_add(A, {"w": torch.ones(2)})
