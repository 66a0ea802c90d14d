"""Fixtures for the device-placement tests: `cuda`, the simulated GPU (see simulated_cuda.py)."""

import pytest
import torch
from simulated_cuda import simulated_cuda


@pytest.fixture
def cuda(monkeypatch):
    """Inside the test, tensors on "cuda" are simulated (real CPU tensors, placement checked like CUDA's)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)  # no queue to wait for
    with simulated_cuda() as device:
        yield device
