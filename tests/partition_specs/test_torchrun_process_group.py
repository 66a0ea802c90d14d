"""Joining torchrun's process group: NCCL bound to the local rank's GPU, gloo on the CPU, and a clear
refusal when a host has fewer GPUs than processes (init_process_group and the GPU count are mocked)."""

from unittest import mock

import pytest
import torch

from ember.core.mesh import MeshError
from ember.core.partition_specs import dtensor

CASES = [  # (GPUs visible, LOCAL_RANK, LOCAL_WORLD_SIZE, expected init_process_group call or error)
    (0, "1", "2", ((("gloo",), {}))),
    (2, "1", "2", (((), {"backend": "nccl", "device_id": torch.device("cuda", 1)}))),
    (1, "0", "2", MeshError),
]


@pytest.mark.parametrize("gpus,rank,local_world,expected", CASES, ids=["cpu_gloo", "nccl_device_id", "too_few_gpus"])
def test_the_process_group_matches_the_devices(monkeypatch, gpus, rank, local_world, expected):
    monkeypatch.setenv("LOCAL_RANK", rank)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with mock.patch.object(torch.cuda, "set_device") as set_device, \
            mock.patch.object(dtensor.dist, "init_process_group") as init:
        if expected is MeshError:
            with pytest.raises(MeshError, match=r"2 processes on this host, but it has 1 GPU.*CUDA_VISIBLE_DEVICES="):
                dtensor.start_torchrun_process_group()
            init.assert_not_called()
            return
        dtensor.start_torchrun_process_group()
    assert (init.call_args.args, init.call_args.kwargs) == expected
    assert [c.args for c in set_device.call_args_list] == ([(int(rank),)] if gpus else [])
