"""launch/train.py on a real CUDA GPU (skips without one): checkpoints and the end-of-run sample
(test_jax_stays_on_cpu.py checks JAX there)."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_train_on_cuda_checkpoints_and_samples(tmp_path):
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--backend", "eager", "--steps", "3",
           "--checkpoint_every", "1", "--out", str(tmp_path / "run"), "--model.n_layers", "1",
           "--data.max_bytes", "50000", "--data.batch_size", "2", "--data.seq_len", "32", "--eval_every", "3",
           "--eval_batches", "1", "--sample_tokens", "8"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-4000:]
    assert "--- sample ---" in out
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())[-1] == "3"
