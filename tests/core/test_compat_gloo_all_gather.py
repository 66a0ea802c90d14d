"""Compiled all-gathers over gloo go through `_allgather_base`, not the coalesced work that corrupts
the heap (core/compat/gloo_all_gather.py). Each test starts two gloo processes
(`_gloo_all_gather_worker.py`); an aborted worker shows as a negative exit code in torchrun's report."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import uuid

import pytest

from ember.core.compat import gated_on, measured_here, torch_minor

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("_gloo_all_gather_worker.py")
ABORTED = re.compile(r"exitcode\s*:\s*-(6|11)\b|malloc\(\)|free\(\)|corrupted")


def _torchrun(*args, disable_patch=False, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in {"PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS"}}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")  # gloo on the CPU, a GPU host too
    if disable_patch:
        env["EMBER_DISABLE_PATCHES"] = "gloo_all_gather_out"
    env["EMBER_GLOO_TEST_RUN"] = token = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",  # a free port
           str(WORKER), *map(str, args)]
    # Its own session, so that a timeout kills the agent, and every process of the run by its token:
    # torchrun starts each worker in a session of its own. A worker spinning in a corrupted gloo loop
    # after its peer aborted outlived torchrun, held the output pipes open (so the test waited 34
    # minutes of a CI run for them) and a core.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a leftover worker holds the pipes open: kill it before reading them
            os.killpg(proc.pid, signal.SIGKILL)
            _kill_processes_with(token)
            proc.communicate()
            raise
        finally:
            _kill_processes_with(token)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _kill_processes_with(token):
    """SIGKILL every process whose environment carries `EMBER_GLOO_TEST_RUN=token`."""
    needle = f"EMBER_GLOO_TEST_RUN={token}".encode()
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):  # gone already, or not ours to read
            continue


def _tail(proc):
    return proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.slow
def test_compiled_gloo_gathers_use_the_out_op_and_survive_many_calls(tmp_path):
    """The regression: 2000 calls of a compiled function with 8 gathers in flight. Without the patch
    this aborted 10 of 12 runs on torch 2.15 (SIGABRT 'malloc(): unaligned tcache chunk detected',
    or SIGSEGV) and 0 of 4 on torch 2.9 (there the repro below shows it)."""
    proc = _torchrun("jit", 2000, tmp_path / "ops.json")
    assert proc.returncode == 0 and proc.stdout.count("WORKER_OK") == 2, _tail(proc)
    assert json.loads((tmp_path / "ops.json").read_text()) == {"coalesced": 0, "out": 8}


@pytest.mark.slow
def test_without_the_patch_the_compiled_gathers_are_coalesced(tmp_path):
    proc = _torchrun("jit", 1, tmp_path / "ops.json", disable_patch=True)
    assert proc.returncode == 0, _tail(proc)
    assert json.loads((tmp_path / "ops.json").read_text()) == {"coalesced": 8, "out": 0}


@pytest.mark.repro
def test_the_out_all_gather_survives_the_load_that_breaks_the_coalesced_one():
    """Plain torch, no ember: the op the patch switches to, under the repro's load (5000 calls, 8 in
    flight). A property of torch, like the repro below: `make test-repro` re-checks both on every line;
    `make test` checks ember's compiled gathers (2000 calls) above."""
    proc = _torchrun("repro", "out", 5000, 8)
    assert proc.returncode == 0 and proc.stdout.count("WORKER_OK") == 2, _tail(proc)


@pytest.mark.repro
def test_the_coalesced_gloo_all_gather_still_corrupts_the_heap():
    """Plain torch, no ember: queued `all_gather_into_tensor` works of gloo abort a process. How
    often one run aborts depends on the machine's load (measured: 6 of 6 runs on an idle 2-core
    machine on torch 2.15, 1 to 4 of 3-4 on torch 2.9; 0 of 6 in a CI run beside the rest of the
    suite), so it is not in `make test`: `make test-repro` runs it on an idle machine, up to 6 runs,
    8 or 16 gathers in flight. If none aborts on a gated torch, that release may have fixed it:
    confirm with more runs, then drop the version from the gate (and the module once no gated torch
    is left)."""
    if not (gated_on("gloo_all_gather_out") and measured_here("gloo_all_gather_out")):
        pytest.skip(f"the bug was not measured on torch {torch_minor()}: the tests above check the fix")
    outcomes = []
    for attempt in range(6):
        try:
            proc = _torchrun("repro", "funcol", 5000, (8, 16)[attempt % 2], timeout=150)
        except subprocess.TimeoutExpired:  # a hang is a symptom too, but not the one checked here
            outcomes.append("timeout")
            continue
        outcomes.append(proc.returncode)
        if proc.returncode != 0:
            assert ABORTED.search(proc.stdout + proc.stderr), _tail(proc)  # an abort, not another error
            return
    pytest.fail(f"6 runs of the repro did not abort ({outcomes}): torch {torch_minor()} may have fixed the "
                f"coalesced gloo all-gather; check, then end WORKAROUNDS['gloo_all_gather_out'].torch before it")
