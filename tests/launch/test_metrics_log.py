"""Tests for ember.launch.metrics_log."""

import json
import math

import pytest
import torch

from ember.launch.metrics_log import MetricsWriter, plot_losses, read_metrics


def test_jsonl_tensorboard_and_plot(tmp_out):
    with MetricsWriter(tmp_out) as w:
        w.write(1, {"loss": torch.tensor(3.0), "lr": torch.tensor(0.1)})
        w.write(2, {"loss": torch.tensor(2.0)})
        w.write(2, {"loss": torch.tensor(2.5)}, prefix="eval_")
    rows = read_metrics(tmp_out)
    assert rows == [{"step": 1, "loss": 3.0, "lr": 0.10000000149011612}, {"step": 2, "loss": 2.0},
                    {"step": 2, "eval_loss": 2.5}]
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_out.iterdir())
    plot_losses(rows, tmp_out / "loss.png")
    assert (tmp_out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nan_is_logged_not_dropped_as_strict_json(tmp_out):
    with MetricsWriter(tmp_out) as w:
        row = w.write(3, {"loss": torch.tensor(float("nan")), "grad_norm": torch.tensor(float("inf")), "lr": 0.5})
    assert row["loss"] != row["loss"]
    line = (tmp_out / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}")) == {
        "step": 3, "loss": None, "grad_norm": None, "lr": 0.5}
    got = read_metrics(tmp_out)[0]
    assert math.isnan(got["loss"]) and math.isnan(got["grad_norm"]) and got["lr"] == 0.5


def test_fresh_run_truncates_and_resume_appends(tmp_out):
    with MetricsWriter(tmp_out, tensorboard=False) as w:
        w.write(1, {"loss": 1.0})
    with MetricsWriter(tmp_out, tensorboard=False) as w:
        w.write(1, {"loss": 2.0})
    with MetricsWriter(tmp_out, tensorboard=False, append=True) as w:
        w.write(2, {"loss": 3.0})
    assert [r["loss"] for r in read_metrics(tmp_out)] == [2.0, 3.0]


def test_a_resumed_writer_keeps_rows_up_to_the_restored_step(tmp_out):
    with MetricsWriter(tmp_out, tensorboard=False) as w:
        for step in (1, 2, 3, 4):
            w.write(step, {"loss": float(step)})
    with MetricsWriter(tmp_out, tensorboard=False, append=True, up_to_step=2) as w:
        w.write(3, {"loss": 30.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_out)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
