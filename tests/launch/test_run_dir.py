"""A run directory is held by one process at a time, and a fresh run never replaces an earlier one's files."""

import multiprocessing
import os
import socket
import subprocess
import sys

import pytest

from ember.launch.run_dir import LOCK_FILE, RunDirectoryError, claim_run_directory


def _snapshot(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_second_process_is_refused_naming_the_pid_holding_the_directory(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out.mkdir()
        (out / LOCK_FILE).write_text(f"{holder.pid} {socket.gethostname()}\n")
        before = _snapshot(out)
        with pytest.raises(RunDirectoryError, match=rf"{out} is in use by process {holder.pid} .*another --out"):
            with claim_run_directory(str(out), resume=False):
                pytest.fail("entered a directory another process holds")
        assert _snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_is_taken_over_with_a_notice_and_released_after(tmp_path):
    out = tmp_path / "run"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out.mkdir()
    (out / LOCK_FILE).write_text(f"{gone.stdout.strip()} {socket.gethostname()}\n")
    notes = []
    with claim_run_directory(str(out), resume=False, say=notes.append):
        assert (out / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    assert notes == [f"note: taking over {out / LOCK_FILE}, left by process {gone.stdout.strip()}, which is no longer running"]
    assert not (out / LOCK_FILE).exists()


def _claim_when_all_are_ready(out, barrier, held, results):
    try:
        barrier.wait()
        with claim_run_directory(out, resume=False, say=lambda _: None):
            results.put("held")
            held.wait()
    except RunDirectoryError as error:
        results.put(str(error))


def test_processes_claiming_at_the_same_instant_let_exactly_one_in(tmp_path):
    """The lock appears with its PID already in it: a process racing the holder never reads it empty and
    takes it over as stale."""
    context = multiprocessing.get_context("fork")
    out = str(tmp_path / "run")
    for _ in range(5):
        n = 6
        barrier, held, results = context.Barrier(n), context.Event(), context.Queue()
        procs = [context.Process(target=_claim_when_all_are_ready, args=(out, barrier, held, results))
                 for _ in range(n)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in range(n)]
        held.set()
        for p in procs:
            p.join(timeout=60)
        assert outcomes.count("held") == 1, outcomes
        assert all("is in use by process" in o for o in outcomes if o != "held"), outcomes
        assert not os.path.isdir(out) or os.listdir(out) == []  # no lock or private file left behind


def test_an_earlier_run_is_refused_kept_on_resume_and_replaced_only_on_overwrite(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "3").mkdir(parents=True)
    for name in ("metrics.jsonl", "config.json", "notes.txt"):
        (out / name).write_text(name)
    before = _snapshot(out)
    with pytest.raises(RunDirectoryError, match=r"already holds a run \(checkpoints, config.json, metrics.jsonl\); "
                                                 r"pass --resume .* --overwrite .* another --out \(nothing was changed\)"):
        with claim_run_directory(str(out), resume=False):
            pass
    assert _snapshot(out) == before and not (out / LOCK_FILE).exists()
    with claim_run_directory(str(out), resume=True):
        pass
    assert _snapshot(out) == before
    with claim_run_directory(str(out), resume=False, overwrite=True):
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE, "notes.txt"]  # only what a run writes goes
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_the_lock_is_released_when_the_run_fails(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ZeroDivisionError):
        with claim_run_directory(str(out), resume=False):
            1 / 0
    with claim_run_directory(str(out), resume=False):  # the next run gets in
        pass
