"""The simulated GPU itself: it raises where CUDA raises and lets through what CUDA lets through."""

import numpy as np
import pytest
import torch
from simulated_cuda import DeviceMismatch, on_device


def test_a_host_array_meeting_a_device_tensor_raises(cuda):
    x = torch.ones(3, device=cuda)
    with pytest.raises(DeviceMismatch, match="same device"):
        x + torch.arange(3)  # made without a device: on the host
    with pytest.raises(DeviceMismatch):
        torch.cat([x, torch.zeros(2)])


def test_what_cuda_allows_is_allowed(cuda):
    x = torch.ones(3, device=cuda)
    assert (x * torch.tensor(2.0)).device == cuda  # a 0-d host tensor is a scalar to CUDA
    assert x[torch.tensor([0, 2])].device == cuda  # host index tensors
    assert (x + torch.arange(3, device=x.device)).is_cuda  # made where x is
    host = torch.empty(3)
    host.copy_(x)  # a device-to-host copy
    assert not host.is_cuda and torch.equal(host, torch.ones(3))


def test_moves_and_numpy(cuda):
    x = torch.from_numpy(np.arange(3.0)).to(cuda)
    assert x.device == torch.device("cuda", 0) and x.cpu().device.type == "cpu"
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        x.numpy()
    assert x.cpu().numpy().tolist() == [0.0, 1.0, 2.0]
    assert float(x.sum()) == 3.0  # values are real


def test_tags_survive_torch_func_transforms(cuda):
    params = on_device({"w": torch.ones(3)})
    grads = torch.func.grad(lambda p: (p["w"] * 2).sum())(params)
    assert grads["w"].is_cuda
    with pytest.raises(DeviceMismatch):
        torch.func.grad(lambda p: (p["w"] * torch.arange(3.0)).sum())(params)
