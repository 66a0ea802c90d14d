"""launch/train.py with the state on a GPU: train, checkpoint, sample, resume, export.

The issue this guards: every CUDA run ended in a traceback after its last checkpoint, because the
end-of-run sample drew its noise with a key made on the CPU.
"""

import pytest
import torch

from ember.launch import ckpt, train

TINY = ["--backend", "eager", "--model.n_layers", "1", "--data.max_bytes", "100000", "--data.batch_size", "2",
        "--data.seq_len", "16", "--log_every", "1", "--eval_every", "5", "--eval_batches", "1", "--sample_tokens", "4",
        "--checkpoint_every", "1"]


@pytest.fixture
def gpu_run(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device_for("eager") picks "cuda"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)  # float32 compute
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args, **kwargs: 0)  # a simulated device has no
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *args, **kwargs: None)  # allocator to ask
    return cuda


def test_train_checkpoint_sample_resume_export(gpu_run, tmp_path, capsys):
    run = tmp_path / "run"
    train.main(["--steps", "2", "--out", str(run), *TINY])
    assert "--- sample ---" in capsys.readouterr().out
    history = train.main(["--steps", "3", "--out", str(run), "--resume", *TINY])  # restores onto the device
    assert history[-1]["step"] == 3 and "--- sample ---" in capsys.readouterr().out
    ckpt.main(["export", str(run), "--out", str(tmp_path / "model.safetensors")])
    assert (tmp_path / "model.safetensors").stat().st_size > 0

