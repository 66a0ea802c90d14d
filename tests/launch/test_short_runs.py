"""The end of short and diverged runs (issue 25): a sample of decodable ids, a notice for skipped
steps, a summary for a single eval point, and a loss plot whose one point shows."""

import dataclasses
import math

import matplotlib.pyplot as plt
import pytest
import torch

from ember.core import random
from ember.core.step_fns import generate, sample_token
from ember.launch import build, train
from ember.launch.loop import train_loop
from ember.launch.metrics_log import MetricsWriter, plot_losses
from ember.launch.report import eval_summary, report_run
from ember.launch.run_config import get_config
from ember.models import build_model
from ember.models.generation import Decoder

TINY = ["--backend", "eager", "--data.max_bytes", "300000", "--data.batch_size", "4", "--data.seq_len", "32",
        "--eval_batches", "1", "--sample_tokens", "64"]
RUN_FILES = {"config.json", "metrics.jsonl", "loss.png"}


@pytest.mark.parametrize("config", ["llama3_tiny", "gpt2_tiny", "deepseek_v3_tiny"])  # the last samples through latents
def test_one_step_run_ends_with_a_sample(config, tmp_out, capsys):
    assert list(tmp_out.iterdir()) == []
    train.main(["--config", config, "--steps", "1", "--out", str(tmp_out), *TINY])  # raised ValueError (ids >= 257)
    out = capsys.readouterr().out
    assert "--- sample ---" in out and "eval loss: " in out
    assert RUN_FILES <= {p.name for p in tmp_out.iterdir()}


def test_sample_token_never_draws_padded_ids():
    logits = torch.zeros(8, 320)
    logits[:, 257:] = 50.0  # the padded rows would win every draw
    for kw in (dict(temperature=0.0), dict(temperature=1.0), dict(top_k=40), dict(top_p=0.9)):
        ids = sample_token(logits, key=random.key(1), vocab_size=257, **kw)
        assert int(ids.max()) < 257, kw
    nan = sample_token(torch.full((4, 320), float("nan")), key=random.key(0), vocab_size=257, top_k=40)
    assert int(nan.max()) < 257


def test_uncached_and_cached_generation_share_the_mask():
    model = build_model("llama3", "tiny", vocab_size=320)
    params = model.init(random.key(0))  # untrained: near-uniform over 320 ids, so 63/320 of draws would be padded
    prompt = torch.tensor([[1, 2, 3]] * 4)
    kw = dict(max_new_tokens=32, key=random.key(2), temperature=1.5, vocab_size=257)
    uncached = generate(model.apply, params, prompt, **kw)
    cached = Decoder(model, backend="eager").generate(params, prompt, **kw)
    assert int(uncached.max()) < 257 and int(cached.max()) < 257
    assert int(generate(model.apply, params, prompt, **{**kw, "vocab_size": None}).max()) >= 257  # the test bites


def test_diverged_params_end_the_run_without_a_sample(tmp_out, capsys):
    cfg = dataclasses.replace(get_config("llama3_tiny"), out=str(tmp_out), sample_tokens=8)
    model = build.build_model(cfg)
    params = model.init(random.key(0))
    params["wte"]["weight"][0, 0] = float("nan")
    history = [{"step": 0, "eval_loss": 5.65}, {"step": 3, "loss": float("nan")}, {"step": 3, "eval_loss": math.nan}]
    report_run(cfg, history, model=model, params=params, tokenizer=build.build_tokenizer(cfg, model), device="cpu")
    out = capsys.readouterr().out
    assert "no sample: the parameters hold NaN" in out and "--- sample ---" not in out
    assert (tmp_out / "loss.png").is_file()


def test_skipped_steps_are_announced_at_log_steps(capsys):
    class State:
        step = torch.tensor(0)
        skipped_steps = torch.tensor(5)  # skipped before this loop (a resumed run): not counted

    def step(state, batch):  # steps 2 and 3 are non-finite; train_step counts them in state.skipped_steps
        state.skipped_steps = state.skipped_steps + int(batch in (2, 3))
        return state, {"loss": torch.tensor(1.0), "skipped": torch.tensor(float(batch in (2, 3)))}

    train_loop(step, State(), iter(range(1, 7)), steps=6, writer=MetricsWriter(None), log_every=2, progress=True)
    out = capsys.readouterr()
    text = out.out + out.err
    assert "step 2: skipped 1 non-finite step so far" in text
    assert "step 4: skipped 2 non-finite steps so far" in text
    assert "step 6: skipped" not in text  # no new skips, no repeat


def test_eval_summary_lines():
    assert eval_summary([{"step": 0, "eval_loss": 5.6502}, {"step": 2, "loss": 5.1}]) == (
        "eval loss: 5.6502 at step 0 (the only evaluation; last train loss 5.1000 at step 2)")
    assert eval_summary([{"step": 0, "eval_loss": 4.0}, {"step": 9, "eval_loss": 3.0}]) == (
        "eval loss: 4.0000 at step 0 -> 3.0000 at step 9 (25.0% lower)")
    assert eval_summary([{"step": 0, "eval_loss": 4.0}, {"step": 9, "eval_loss": 5.0}]).endswith("(25.0% higher)")
    assert eval_summary([{"step": 0, "eval_loss": 4.0}, {"step": 9, "eval_loss": math.nan}]).endswith("nan at step 9")


@pytest.mark.parametrize("n, marker", [(1, "o"), (5, "o"), (200, "None")])
def test_loss_plot_marks_few_points(n, marker, tmp_out, monkeypatch):
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    assert not (tmp_out / "loss.png").exists()
    plot_losses([{"step": i + 1, "loss": 5.0 - i / n} for i in range(n)], tmp_out / "loss.png")
    assert (tmp_out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (line,) = figs[0].axes[0].get_lines()
    assert line.get_marker() == marker
