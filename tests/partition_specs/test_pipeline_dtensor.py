"""A stacked Llama over meshes with `pp=2` (DTensor, gloo): `layers -> pp` splits the blocks by stage, and the
step's gradients, SGD losses and final parameters equal one device's, on every process, eagerly: with as few
microbatches as stages, with 2 repeats (each process's block of layers exchanged for its stages' layers of both
repeats), beside `fsdp` (the stages' layers gathered once per step) and `dp`, beside `tp` (each stage's layers
split by heads and features) and `cp` (each sequence split, in its head-tail order); packed `segment_ids` travel
with their microbatch, and the tied embedding (read by the first stage, the head on every process) gets its
whole gradient. A Qwen3-MoE of two dense blocks then two of experts (two runs, each pipelined) on `pp=2,ep=2`,
eagerly and compiled by ember's `jit`: the experts stored split over `ep`, the router statistics summed over
microbatches and processes (the auxiliary loss and its gradient as one device's). `pp=2` compiled runs under
torchrun in tests/launch/test_torchrun_pp_cp.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _pipeline_dtensor_worker as W  # noqa: E402
from _gloo_runs import one_device, run_worlds  # noqa: E402

from ember.core.compat import gated_on  # noqa: E402

pytestmark = pytest.mark.xdist_group("pipeline_dtensor")  # one worker runs the module: its fixtures run once
ATOL = 1e-5
CASES = [(world, name) for world, cases in W.CASES.items() for name in cases]


@pytest.fixture(scope="module")
def reference():
    return {name: one_device(W.setup(name)) for name in W.MODELS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_worlds(W.__file__, W.CASES, tmp_path_factory, "pipeline_dtensor")


@pytest.mark.slow
@pytest.mark.parametrize("world,case", CASES)
def test_pp2_step_equals_one_device_on_every_process(runs, reference, world, case):
    mesh, *_, model, _ = W.CASES[world][case]
    if "cp" in mesh and gated_on("dtensor_sequence_fold"):
        pytest.skip("context parallelism refuses on this torch (dtensor_sequence_fold)")
    want = reference[model]
    for rank in range(world):
        res = runs[world, rank][case]
        assert "error" not in res, f"{case} failed in the worker on rank {rank}:\n{res['error']}"
        if model == "moe":  # each process: its stage's layer of each run, and its 2 of the 4 experts
            assert res["local"]["blocks.0.attn.wq.weight"][0] == res["local"]["blocks.1.attn.wq.weight"][0] == 1
            assert res["local"]["blocks.1.mlp.gate"][:2] == [1, W.MOE["n_experts"] // 2]
        else:
            (layers, rows, _), d = res["local"]["blocks.attn.wq.weight"], res["local"]["wte.weight"][1]
            assert layers == W.LLAMA["n_layers"] // 2  # each process: its stage's layers
            assert d == W.LLAMA["d_model"] // (2 if "fsdp" in mesh else 1)  # the rest whole, or split over fsdp
            assert rows == W.LLAMA["d_model"] // (2 if "tp" in mesh else 1)  # the query heads split over tp
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want["losses"]), rtol=0, atol=ATOL)
        for path, grad in want["grads"].items():
            torch.testing.assert_close(torch.tensor(res["grads"][path]), grad, rtol=0, atol=ATOL, msg=path)
        for path, param in want["params"].items():
            torch.testing.assert_close(torch.tensor(res["params"][path]), param, rtol=0, atol=ATOL, msg=path)
