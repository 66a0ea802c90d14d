"""`--optim.name muon`: the run config's Muon is the hand-written one (clip, then Muon on the model's hidden matrices
by their logical axes, AdamW on the rest, each group's rate on the run's schedule), and `launch/train.py` trains
with it."""

from __future__ import annotations

import json

import pytest
import torch

from ember import optim
from ember.core import TrainState, random
from ember.core.pytree import tree_leaves_with_path
from ember.core.step_fns import train_step
from ember.models import build_model, lm_loss

LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16)


def test_the_configs_muon_is_clip_then_muon_by_the_models_axes():
    model = build_model("llama3", "tiny", **LLAMA)
    cfg = optim.OptimConfig(name="muon", learning_rate=2e-2, adamw_learning_rate=4e-3, schedule="wsd",
                            warmup_steps=1, muon_momentum=0.9, weight_decay=0.05, clip_norm=1.0)
    ours = optim.from_config(cfg, total_steps=20, axes=model.axes)
    lr = optim.schedule_from_config(cfg, total_steps=20)
    adam_lr = optim.schedule_from_config(cfg, total_steps=20, peak=4e-3)
    by_hand = optim.chain(optim.inject_hyperparams(optim.clip_by_global_norm)(max_norm=1.0), optim.muon(
        lr, beta=0.9, eps=1e-8, weight_decay=0.05, adam_b1=0.9, adam_b2=0.95, adam_weight_decay=0.05,
        adam_learning_rate=adam_lr, consistent_rms=0.2, param_labels=optim.muon_labels(model.axes)))
    params = model.init(random.key(0))
    tokens = random.randint(random.key(1), (3, 4, 17), 0, LLAMA["vocab_size"])
    states = [TrainState.create(params=params, tx=tx, key=random.key(2)) for tx in (ours, by_hand)]
    step = train_step(lm_loss(model))
    for t in tokens:
        batch = {"inputs": t[:, :-1], "targets": t[:, 1:]}
        (states[0], metrics), (states[1], _) = step(states[0], batch), step(states[1], batch)
    for (path, a), (_, b) in zip(tree_leaves_with_path(states[0].params), tree_leaves_with_path(states[1].params)):
        assert torch.equal(a, b), path
    assert float(metrics["lr/adam"]) == pytest.approx(4e-3) and float(metrics["lr"]) == pytest.approx(2e-2)


def test_the_configs_muon_needs_the_models_axes():
    with pytest.raises(ValueError, match=r"pass them: from_config\(cfg, total_steps=\.\.\., axes=model.axes\)"):
        optim.from_config(optim.OptimConfig(name="muon"), total_steps=10)


def test_a_muon_flag_with_another_optimizer_is_one_line_naming_the_fix():
    with pytest.raises(ValueError, match="optim.adamw_learning_rate is read by Muon only, but optim.name='lion'; "
                                         "drop --optim.adamw_learning_rate or choose --optim.name muon"):
        optim.OptimConfig(name="lion", adamw_learning_rate=1e-3)


def test_train_py_trains_with_muon(tmp_path):
    from ember.launch import train
    from ember.launch.cli import run_main

    out = tmp_path / "run"
    argv = ["--optim.name", "muon", "--optim.schedule", "wsd", "--steps", "3", "--log_every", "1",
            "--checkpoint_every", "0", "--backend", "eager", "--model.n_layers", "1", "--data.seq_len", "32",
            "--data.batch_size", "4", "--sample_tokens", "0", "--data.max_bytes", "100000", "--out", str(out)]
    assert run_main(lambda: train.main(argv)) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("lr/adam" in row for row in rows) and all(row.get("loss", 0.0) == row.get("loss", 0.0) for row in rows)


def test_a_muon_run_resumed_from_a_checkpoint_is_bit_identical(tmp_path):
    from ember.core.checkpoint import CheckpointManager

    model = build_model("llama3", "tiny", **LLAMA)
    tx = optim.from_config(optim.OptimConfig(name="muon", schedule="wsd", warmup_steps=1), total_steps=4,
                           axes=model.axes)
    fresh = lambda: TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(2))  # noqa: E731
    tokens = random.randint(random.key(1), (4, 4, 17), 0, LLAMA["vocab_size"])
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    step = train_step(lm_loss(model))
    straight = fresh()
    for batch in batches:
        straight, _ = step(straight, batch)
    resumed = fresh()
    for batch in batches[:2]:
        resumed, _ = step(resumed, batch)
    manager = CheckpointManager(str(tmp_path), save_every=1, async_save=False)
    manager.save(2, resumed)
    resumed, _, _ = manager.restore(2, like=fresh())
    for batch in batches[2:]:
        resumed, _ = step(resumed, batch)
    for (path, a), (_, b) in zip(tree_leaves_with_path(straight), tree_leaves_with_path(resumed)):
        assert torch.equal(a, b), path
