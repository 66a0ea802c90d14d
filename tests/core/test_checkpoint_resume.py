"""Bit-identical resume and crash safety of ember.core.checkpoint on a real (tiny) training run.

The run (`_ckpt_train.py`): GPT-2 with dropout 0.1, AdamW with warm-up, clipping and
hyperparameter tensors, batches from the grain pipeline over the stdlib corpus. "Straight" trains
2N steps and, at step N, saves asynchronously while it keeps training on the donated buffers;
"resumed" restores step N into a state built from another seed and trains N more. Params,
optimizer state and every loss must be equal bit for bit.
"""

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from ember.core.checkpoint import CheckpointError, CheckpointManager

HERE = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location("ember_test_ckpt_train", HERE / "_ckpt_train.py")
T = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = T  # torch.compile looks traced functions' modules up by name
_spec.loader.exec_module(T)

N = T.TOTAL_STEPS // 2
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parents[2]), os.environ.get("PYTHONPATH")]))}


def assert_leaves_equal(a, b):
    assert a.keys() == b.keys()
    for path in a:
        assert a[path].dtype == b[path].dtype, path
        assert torch.equal(a[path], b[path]), path


def straight_run(step, tmp_path):
    """2N steps from seed 0, saving step N (async) into tmp_path / 'ckpt' mid-run."""
    s = T.setup()
    it = T.batches(s)
    state, first = T.run(step, T.fresh_state(s), it, N)
    ckpt = CheckpointManager(tmp_path / "ckpt", save_every=N)
    assert ckpt.save(N, state, data_state=it.get_state(), metrics={"loss": first[-1]})
    at_n = T.leaves(state)
    state, second = T.run(step, state, it, N)  # donated steps overwrite the buffers being saved
    ckpt.close()
    return at_n, T.leaves(state), first + second


def resumed_run(step, ckpt_dir, *, num_workers=0):
    s = T.setup(num_workers=num_workers)
    with CheckpointManager(ckpt_dir, read_only=True) as ckpt:
        state, data_state, meta = ckpt.restore(like=T.fresh_state(s, seed=123))
    at_n = T.leaves(state)
    it = T.batches(s)
    it.set_state(data_state)
    state, losses = T.run(step, state, it, T.TOTAL_STEPS - meta.step)
    it.pipeline.close()
    return at_n, T.leaves(state), losses


def test_eager_resume_is_bit_identical(tmp_path):
    step = T.make_step(T.setup(), "eager")
    at_n, final, losses = straight_run(step, tmp_path)
    r_at_n, r_final, r_losses = resumed_run(step, tmp_path / "ckpt")
    assert_leaves_equal(r_at_n, at_n)
    assert_leaves_equal(r_final, final)
    assert all(torch.equal(a, b) for a, b in zip(r_losses, losses[N:])), (r_losses, losses[N:])
    assert len(r_losses) == N


def test_resume_in_a_new_process_with_data_workers_is_bit_identical(tmp_path):
    step = T.make_step(T.setup(), "eager")
    _, final, losses = straight_run(step, tmp_path)
    out = tmp_path / "resumed.pt"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_ckpt_train.py"), "resume", str(tmp_path / "ckpt"), str(T.TOTAL_STEPS), str(out),
         "--workers", "1"],
        capture_output=True, text=True, env=ENV, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    assert got["start"] == N
    assert_leaves_equal(got["leaves"], final)
    assert all(torch.equal(a, b) for a, b in zip(got["losses"], losses[N:])) and len(got["losses"]) == N


@pytest.fixture(scope="module")
def inductor_step():
    return T.make_step(T.setup(), "inductor")


@pytest.mark.slow
def test_inductor_resume_is_bit_identical_and_does_not_recompile(tmp_path, inductor_step):
    at_n, final, losses = straight_run(inductor_step, tmp_path)
    compiles = inductor_step.compile_count
    r_at_n, r_final, r_losses = resumed_run(inductor_step, tmp_path / "ckpt")
    assert inductor_step.compile_count == compiles  # restored tensors match the compiled signature
    assert_leaves_equal(r_at_n, at_n)
    assert_leaves_equal(r_final, final)
    assert all(torch.equal(a, b) for a, b in zip(r_losses, losses[N:]))


# ---- crash safety ------------------------------------------------------------------------------

KILL_DELAYS_S = [0.0, 0.03, 0.09, 0.2]  # after a save starts: mid-copy, mid-write, near commit, next save


def _start_worker(directory):
    return subprocess.Popen([sys.executable, "-u", str(HERE / "_ckpt_crash_worker.py"), str(directory)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)


def _kill_during_a_save(directory, delay):
    proc = _start_worker(directory)
    try:
        saving = 0
        for line in proc.stdout:
            if line.startswith("SAVING"):
                saving += 1
                if saving == 2:  # the second save: the first one has been committed meanwhile
                    time.sleep(delay)
                    break
        else:
            pytest.fail(f"the crash worker exited early with code {proc.wait()}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_sigkill_during_async_saves_keeps_the_last_committed_step(tmp_path):
    directory = tmp_path / "ckpt"
    seen_unfinished = 0
    latest = None
    for delay in KILL_DELAYS_S:
        _kill_during_a_save(directory, delay)
        seen_unfinished += bool(list(directory.glob("*.orbax-checkpoint-tmp*")))
        with CheckpointManager(directory, save_every=1, max_to_keep=2) as ckpt:  # cleans unfinished saves
            assert not list(directory.glob("*.orbax-checkpoint-tmp*"))
            step = ckpt.latest_step()
            assert step is not None and (latest is None or step > latest)
            like = {"params": {k: torch.zeros(s) for k, s in T_SHAPES.items()}, "step": torch.tensor(0),
                    "half": torch.zeros(64, dtype=torch.bfloat16)}
            for s in ckpt.all_steps():  # committed steps read back whole, filled with their number
                try:
                    state, _, _ = ckpt.restore(s, like=like)
                except CheckpointError:
                    # orbax prunes old steps with a plain rmtree: a kill mid-prune can leave an older
                    # step half-deleted (never the latest), and reading it must fail loudly.
                    assert s < step
                    continue
                assert state["step"].item() == s
                for x in (*state["params"].values(), state["half"]):
                    assert bool((x == s).all()), (s, x.flatten()[:4])
            latest = step
    assert seen_unfinished >= 1, "no kill landed inside a save; the test did not exercise the crash path"
    # The next run resumes from the last committed step and saves on top of it.
    proc = _start_worker(directory)
    try:
        assert proc.stdout.readline().strip() == f"READY {latest}"
        assert proc.stdout.readline().strip() == f"SAVING {latest + 1}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


T_SHAPES = {"a": (1024, 2048), "b": (2048, 1024), "c": (512, 512)}  # the worker's SHAPES
