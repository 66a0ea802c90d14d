"""Collators: numpy batch -> torch tensors, and the collator registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.data import available_collators, collator, get_collator, identity_collate, to_torch


def batch(dtype=np.int64):
    x = np.arange(12, dtype=dtype).reshape(3, 4)
    return {"inputs": x, "targets": x + 1}


def test_to_torch_is_zero_copy_for_int64():
    b = batch()
    t = to_torch(b, pin_memory=False)
    assert set(t) == {"inputs", "targets"}
    assert t["inputs"].dtype == torch.int64 and tuple(t["inputs"].shape) == (3, 4)
    assert t["inputs"].data_ptr() == b["inputs"].__array_interface__["data"][0]  # shares memory
    np.testing.assert_array_equal(t["targets"].numpy(), b["targets"])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint32])
def test_to_torch_casts_other_int_dtypes_to_int64(dtype):
    t = to_torch(batch(dtype))
    assert t["inputs"].dtype == torch.int64
    np.testing.assert_array_equal(t["inputs"].numpy(), np.arange(12).reshape(3, 4))


def test_to_torch_keeps_floats_handles_readonly_and_moves_device():
    ro = np.arange(4, dtype=np.int64)
    ro.setflags(write=False)
    t = to_torch({"ids": ro, "mask": np.ones(4, dtype=np.float32)}, device="cpu")
    assert t["mask"].dtype == torch.float32 and t["ids"].device.type == "cpu"
    assert not t["ids"].is_pinned()  # no CUDA here, or a CPU target: nothing to pin for
    with pytest.raises(TypeError, match=r"batch\['bad'\] must be a numpy array"):
        to_torch({"bad": "text"})
    with pytest.raises(TypeError, match="batch must be a dict of arrays"):
        to_torch([np.zeros(2)])


@pytest.mark.gpu
def test_to_torch_pins_when_cuda_is_present():
    t = to_torch(batch())
    assert t["inputs"].is_pinned()
    assert to_torch(batch(), device="cuda")["inputs"].is_cuda


def test_registry_lookup_and_builtins():
    assert {"torch", "numpy"} <= set(available_collators())
    assert get_collator("torch") is to_torch
    assert get_collator("numpy") is identity_collate
    b = batch()
    assert get_collator("numpy")(b) is b


def test_registry_duplicate_and_unknown_names():
    name = "test_collate_registry_case"

    @collator(name)
    def mine(b, *, device=None):
        return b

    assert get_collator(name) is mine
    with pytest.raises(ValueError, match=rf"collator '{name}' is already registered .*mine"):
        collator(name)(mine)
    with pytest.raises(ValueError, match=r"unknown collator 'trch'; did you mean 'torch'\? Known: \[.*'numpy'.*\]"):
        get_collator("trch")
