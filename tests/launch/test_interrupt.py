"""Ctrl-C and SIGTERM end a run after the current step: final checkpoint, metrics and plot kept, exit 130 / 143."""

import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from ember.launch.interrupt import GracefulStop, RunInterrupted
from ember.launch.quiet import NOISE

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "launch" / "train.py")
# Fast, deterministic steps; a constant learning rate, so a shorter reference run has the same steps.
TINY = ["--backend", "eager", "--model.n_layers", "1", "--data.batch_size", "4", "--data.seq_len", "32",
        "--log_every", "1", "--sample_tokens", "0", "--optim.schedule", "constant", "--data.max_bytes", "200000"]
ENV = {**{k: v for k, v in os.environ.items() if k not in ("EMBER_DEBUG", "RANK", "WORLD_SIZE")},
       "CUDA_VISIBLE_DEVICES": ""}  # the torchrun case starts 2 gloo ranks on the CPU, a GPU host too


def _strict_rows(out):
    def refuse(token):
        raise ValueError(f"metrics.jsonl holds {token}, which strict JSON refuses")

    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out):
    return {r["step"]: r["loss"] for r in _strict_rows(out) if "loss" in r}


def _start(argv, command=(sys.executable, TRAIN)):
    return subprocess.Popen([*command, *argv, *TINY], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _signal_after(proc, out, step, signum=signal.SIGINT, timeout=900):
    """Send `signum` once metrics.jsonl has a row for `step`; the process's (rc, stdout, stderr)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and step in _losses(out):
            proc.send_signal(signum)
            break
        time.sleep(0.02)
    stdout, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, stdout, stderr


def _stopped_step(stderr):
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("stopped at step "), stderr[-2000:]
    return int(line.split()[3])


def test_graceful_stop_turns_the_first_signal_into_a_request_and_the_second_ctrl_c_into_an_exit():
    said = []
    before = signal.getsignal(signal.SIGINT)
    with GracefulStop(say=said.append) as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() and "SIGINT received: stopping after the current step" in said[0]
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's SIGTERM after a Ctrl-C: already stopping
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(RunInterrupted, match=r"stopped at step 7 of 9 \(SIGINT\): checkpoint saved at step 7") as info:
        stop.raise_if_stopped(step=7, steps=9, checkpoint_dir="d", saved_step=7)
    assert info.value.exit_code == 130


@pytest.mark.slow
def test_sigint_with_checkpoints_saves_the_stopped_step_and_resume_continues_bit_for_bit(tmp_path):
    run, ref = tmp_path / "run", tmp_path / "ref"
    argv = ["--steps", "400", "--checkpoint_every", "10", "--out", str(run)]
    rc, _, err = _signal_after(_start(argv), run, random.randint(3, 8))
    assert rc == 130, err[-2000:]
    stopped = _stopped_step(err)
    assert f"checkpoint saved at step {stopped} in {run / 'checkpoints'}; continue with" in err
    assert "Traceback" not in err
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())[-1] == stopped
    assert (run / "loss.png").is_file() and not (run / ".ember.lock").exists()
    assert max(_losses(run)) == stopped  # the stopped step's metrics were flushed, nothing after it

    end = stopped + 4
    resumed = subprocess.run([sys.executable, TRAIN, *argv[2:], "--steps", str(end), "--resume", *TINY],
                             capture_output=True, text=True, env=ENV, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from step {stopped}" in resumed.stdout
    whole = subprocess.run([sys.executable, TRAIN, "--steps", str(end), "--checkpoint_every", "-1", "--out", str(ref),
                            *TINY], capture_output=True, text=True, env=ENV, timeout=900)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert _losses(run) == _losses(ref)  # exactly, step by step: one row per step


@pytest.mark.slow
def test_sigint_without_checkpoints_keeps_metrics_and_plot_and_says_how_to_resume_next_time(tmp_path):
    run = tmp_path / "run"
    rc, _, err = _signal_after(_start(["--steps", "400", "--out", str(run)]), run, 3)
    assert rc == 130, err[-2000:]
    assert "no checkpoint (checkpoints are off): pass --out DIR --checkpoint_every N" in err.strip().splitlines()[-1]
    assert (run / "loss.png").is_file() and not (run / "checkpoints").exists()
    assert max(_losses(run)) == _stopped_step(err)


@pytest.mark.slow
def test_ctrl_c_of_the_nproc_per_node_launcher_stops_every_rank_with_a_checkpoint_and_exits_130(tmp_path):
    """Ctrl-C from a terminal reaches the launcher and its ranks (one process group): every rank stops after
    the same step, rank 0 says where and how to resume, and the launcher exits 130 as one process does."""
    run = tmp_path / "run"
    argv = [TRAIN, "--nproc-per-node", "2", "--mesh", "dp=2", "--steps", "400", "--checkpoint_every", "10",
            "--out", str(run), *TINY]
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").exists() and 3 in _losses(run):
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    step = _stopped_step(err)  # the last line: rank 0's, once
    assert f"(SIGINT): checkpoint saved at step {step} in {run / 'checkpoints'}; continue with" in err
    assert err.count("stopped at step ") == 1 and "Traceback" not in err and "error:" not in err, err[-3000:]
    assert not any(noise in err for noise in NOISE), err[-3000:]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())[-1] == step
    assert max(_losses(run)) == step


def test_a_mistake_under_the_nproc_per_node_launcher_is_one_line_and_exit_2_before_any_rank_starts(tmp_path):
    """8 experts do not split over ep=3: refused by the launcher itself, so no rank starts and no
    torchrun-style failure report buries the line."""
    proc = subprocess.run([sys.executable, TRAIN, "--nproc-per-node", "3", "--config", "qwen3_moe_tiny", "--mesh",
                           "ep=3", "--out", str(tmp_path / "run"), *TINY], capture_output=True, text=True, env=ENV,
                          timeout=900)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]  # one line
    assert proc.stderr.startswith("error: ") and "do not split evenly over ep=3" in proc.stderr
    assert "precision:" not in proc.stdout and not (tmp_path / "run").exists()  # no rank printed or wrote


@pytest.mark.slow
def test_two_runs_started_at_once_into_one_out_one_trains_the_other_exits_2(tmp_path):
    run = tmp_path / "run"
    argv = ["--steps", "30", "--out", str(run)]
    procs = [_start(argv) for _ in range(2)]
    results = [(p.wait(timeout=900), *p.communicate()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], [err[-1500:] for _, _, err in results]
    loser = next(err for rc, _, err in results if rc == 2)
    assert loser.strip().splitlines()[-1].startswith(f"error: {run} is in use by process ")
    assert sorted(_losses(run)) == list(range(1, 31))  # strict JSON, one row per step
