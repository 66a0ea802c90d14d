"""`run_in_own_group`: a command run in a process group of its own, the whole group killed when it ends."""

from __future__ import annotations

import os
import signal
import subprocess


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
