"""`launch/train.py --mesh pp=2` and `--mesh cp=2` under torchrun (gloo, Inductor), against the same run in
one process: a stacked `llama3_tiny` split into two pipeline stages run twice (`--pipeline_repeats 2`: stage 0
runs layers 0 and 2, stage 1 layers 1 and 3), four pipeline microbatches, whose checkpoint then resumes in one
process (the stacked layers' layout does not change with pp); and the
same model with every sequence split over two processes (the data in cp's head-tail order), resumed in one
process too; and both at once (`--mesh pp=2,cp=2`, four processes, eagerly)."""

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from ember.launch.metrics_log import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
# a constant learning rate: a schedule over --steps would differ between a 2-step run resumed to 4 and a 4-step run
SHORT = ["--model.scan_layers", "true", "--data.max_bytes", "300000", "--log_every", "1", "--eval_every", "0",
         "--sample_tokens", "0", "--optim.schedule", "constant", "--pipeline_microbatches", "4"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]  # + the mesh's size
STEPS = 4

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                                 reason="the torch_xla environment runs the launchers as tpu_pod.py"),
              pytest.mark.xdist_group("torchrun_pp_cp")]  # one worker runs the module: its reference runs once


def _train(out: pathlib.Path, *prefix: str, args=()) -> list:
    xla = {"PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS"}  # an earlier XLA test may have set them
    env = {**{k: v for k, v in os.environ.items() if k not in xla}, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # gloo ranks on the CPU, a GPU host too
    cmd = [*prefix, str(ROOT / "launch" / "train.py"), *SHORT, *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, cwd=ROOT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return [(r["step"], r["loss"]) for r in read_metrics(out) if "loss" in r]


def _assert_same(got, want):
    assert [s for s, _ in got] == [s for s, _ in want]
    torch.testing.assert_close(torch.tensor([x for _, x in got]), torch.tensor([x for _, x in want]), rtol=0, atol=2e-4)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("single") / "run", sys.executable, args=["--steps", str(STEPS)])


def _matches_then_resumes_in_one_process(run, mesh, single, *options):
    """Two steps on `mesh` under torchrun, then steps 3 and 4 resumed in one process: all as `single`. The
    resumed run is eager (the compiled step is the torchrun run's; the restore does not depend on it)."""
    processes = math.prod(int(axis.split("=")[1]) for axis in mesh.split(","))
    _assert_same(_train(run, *TORCHRUN, str(processes),
                        args=["--mesh", mesh, *options, "--steps", "2", "--checkpoint_every", "0"]), single[:2])
    _train(run, sys.executable,
           args=["--steps", str(STEPS), "--resume", "--checkpoint_every", "0", "--backend", "eager"])
    resumed = [(s, x) for s, x in [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r] if s > 2]
    _assert_same(resumed, single[2:])


@pytest.mark.slow
def test_pp2_run_matches_one_process_and_resumes_in_one_process(tmp_path_factory, single):
    _matches_then_resumes_in_one_process(tmp_path_factory.mktemp("pp_mesh") / "run", "pp=2", single,
                                         "--pipeline_repeats", "2")


@pytest.mark.slow
def test_cp2_run_matches_one_process_and_resumes_in_one_process(tmp_path_factory, single):
    # parameters are whole over cp, and the data pipeline's state does not depend on cp
    _matches_then_resumes_in_one_process(tmp_path_factory.mktemp("cp_mesh") / "run", "cp=2", single)


@pytest.mark.slow
def test_pp2_cp2_run_matches_one_process_and_resumes_in_one_process(tmp_path_factory, single):
    # four processes: each runs its stage's layers on its half of every sequence. Eagerly: four processes compiling
    # the schedule on two cores take over 8 minutes; the compiled pp=2,cp=2 step is test_pipeline_dtensor.py's
    _matches_then_resumes_in_one_process(tmp_path_factory.mktemp("pp_cp_mesh") / "run", "pp=2,cp=2", single,
                                         "--backend", "eager")
