"""ember.launch.throughput in the loop: every logged row carries tokens/s, MFU, step time split and peak memory."""

import time

import pytest
import torch

from ember.core import TrainState
from ember.launch import train
from ember.launch.loop import train_loop
from ember.launch.metrics_log import MetricsWriter, read_metrics
from ember.launch.throughput import THROUGHPUT_KEYS, Throughput

TINY = ["--backend", "eager", "--model.n_layers", "1", "--data.max_bytes", "100000", "--data.batch_size", "4",
        "--data.seq_len", "32", "--eval_every", "0", "--sample_tokens", "0", "--log_every", "2", "--steps", "6"]


def test_every_logged_row_of_a_run_carries_throughput_mfu_time_and_memory(tmp_path, capsys):
    train.main([*TINY, "--out", str(tmp_path / "run")])
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [2, 4, 6]
    for row in rows:
        assert set(THROUGHPUT_KEYS) <= set(row), row
        assert 0 < row["throughput/mfu"] <= 1, row  # the CPU's peak is measured: a tiny model is far below it
        assert row["throughput/tokens_per_s"] == pytest.approx(4 * 32 / row["time/step_s"])
        assert 0 <= row["time/data_wait_s"] <= row["time/step_s"]
        assert row["time/data_wait_s"] + row["time/compute_s"] == pytest.approx(row["time/step_s"])
        assert row["memory/peak_gib"] > 0  # the process's peak RSS
    said = capsys.readouterr()
    assert "GFLOP per step (FlopCounterMode)" in said.out and "measured on cpu" in said.out


class _Halve:
    init = staticmethod(lambda p: {})
    update = staticmethod(lambda g, s, p=None: ({k: -0.5 * v for k, v in g.items()}, s))


def test_the_first_steps_row_has_no_time_of_its_own_and_data_wait_is_measured():
    def slow_batches():  # 20 ms in next(batches) each
        while True:
            time.sleep(0.02)
            yield torch.tensor(1.0)

    def step(state, batch):
        grads = {"w": state.params["w"] - batch}
        return state.apply_gradients(grads=grads), {"loss": grads["w"].pow(2)}

    writer = MetricsWriter(None)
    state = TrainState.create(params={"w": torch.zeros(())}, tx=_Halve())
    meter = Throughput(tokens_per_step=8, flops=lambda s, b: 100, peak=1e6)
    train_loop(step, state, slow_batches(), steps=3, writer=writer, log_every=1, progress=False, throughput=meter)
    first, *rest = writer.history
    assert "time/step_s" not in first and "memory/peak_gib" in first  # step 1's time was its compile
    assert meter.flops_per_step == 100 and all({"throughput/mfu", "throughput/tokens_per_s"} <= set(r) for r in rest)
    assert all(0.02 <= r["time/data_wait_s"] <= r["time/step_s"] for r in rest)
