"""`run_in_own_group`: a command run in a process group of its own, the whole group killed when it ends;
`end_gloo_rank`: a gloo rank's exit once its work is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def run_in_own_group(command: list, *, timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """Run `command` in its own process group and kill the whole group (a launcher's ranks too) when it ends
    or times out, so nothing it started keeps running beside the next test."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **popen_kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def end_gloo_rank() -> None:
    """End a gloo rank whose results are written: every rank meets at a barrier, then the process exits 0
    without tearing the group down. Tearing a gloo group down at exit now and then aborts a rank
    ("terminate called without an active exception", SIGABRT; in CI after every result was written, once
    after a barrier and `destroy_process_group`), which would read as a failure of the code under test."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
