"""The launcher's compiled DTensor step over gloo runs its steps without corrupting the host heap
(core/compat/gloo_all_gather.py): `--mesh fsdp=2` on two processes, a 1-layer model, 40 steps."""

import os
import pathlib
import subprocess
import sys

import pytest

from ember.launch.metrics_log import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGS = ["--mesh", "fsdp=2", "--steps", "40", "--model.n_layers", "1", "--data.max_bytes", "300000",
        "--log_every", "10", "--eval_batches", "1", "--sample_tokens", "8"]


@pytest.mark.slow
def test_fsdp_steps_under_torchrun_finish_without_a_heap_abort(tmp_path):
    """Before the gloo all-gather patch, this command aborted a worker in about every second run
    ('malloc(): unaligned tcache chunk detected' or SIGSEGV, at steps 2-40)."""
    env = {k: v for k, v in os.environ.items() if k not in {"PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS"}}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")  # gloo on the CPU, a GPU host too
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "launch" / "train.py"), *ARGS, "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "malloc()" not in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [10, 20, 30, 40]
