"""A run directory (`--out`) as a unit of work: one process at a time, and nothing of an earlier run lost.

    with claim_run_directory(cfg.out, resume=args.resume, overwrite=args.overwrite):
        ...train, write metrics, checkpoints, the plot...

A lock file `OUT/.ember.lock` holds the PID and host of the process using the directory; a second
process is refused at once, naming that PID. A lock left by a process that no longer runs (on this
host) is taken over with a notice. A fresh run into a directory that already holds a run's files is
refused unless `--resume` (continue it) or `--overwrite` (replace it: only the files a run writes
are removed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from typing import Iterator, List, Optional

from ember.launch.checkpointing import CHECKPOINTS_DIR
from ember.launch.metrics_log import METRICS_FILE
from ember.launch.report import CONFIG_FILE, PLOT_FILE

__all__ = ["LOCK_FILE", "RUN_FILES", "RunDirectoryError", "claim_run_directory", "run_files"]

LOCK_FILE = ".ember.lock"
RUN_FILES = (METRICS_FILE, CONFIG_FILE, PLOT_FILE, CHECKPOINTS_DIR)  # and TensorBoard events


class RunDirectoryError(ValueError):
    """The run directory is in use by another process, or holds a run this command would overwrite."""


def run_files(out: str) -> List[str]:
    """The names in `out` that an earlier run wrote."""
    if not os.path.isdir(out):
        return []
    return sorted(n for n in os.listdir(out) if n in RUN_FILES or n.startswith("events.out.tfevents"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_lock(out: str, say) -> str:
    path = os.path.join(out, LOCK_FILE)
    me = f"{os.getpid()} {socket.gethostname()}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            with open(path) as f:
                pid_text, _, host = f.read().strip().partition(" ")
            pid = int(pid_text) if pid_text.isdigit() else -1
            if host and host != socket.gethostname():
                raise RunDirectoryError(f"{out} is in use by process {pid} on host {host} ({path}); wait for it, "
                                        f"or pass another --out. Delete {path} if that run is gone.") from None
            if pid > 0 and _alive(pid):
                raise RunDirectoryError(f"{out} is in use by process {pid} (lock {path}); wait for it to finish, "
                                        f"or pass another --out.") from None
            say(f"note: taking over {path}, left by process {pid}, which is no longer running")
            os.unlink(path)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me + "\n")
        return path
    raise RunDirectoryError(f"could not take the lock {path}; another process is starting in {out}.")


@contextlib.contextmanager
def claim_run_directory(out: Optional[str], *, resume: bool, overwrite: bool = False, say=print) -> Iterator[None]:
    """Hold `out` for this run: lock it, refuse to overwrite an earlier run, release on exit.

    Raises:
        RunDirectoryError: another live process holds `out`; or `out` holds an earlier run's files and
            neither `resume` nor `overwrite` is set (names the files and both flags).
    """
    if out is None:
        yield
        return
    os.makedirs(out, exist_ok=True)
    lock = _take_lock(out, say)
    try:
        existing = run_files(out)
        if existing and not resume:
            if not overwrite:
                raise RunDirectoryError(
                    f"{out} already holds a run ({', '.join(existing)}); pass --resume to continue it, "
                    f"--overwrite to replace it, or another --out (nothing was changed)."
                )
            for name in existing:
                target = os.path.join(out, name)
                shutil.rmtree(target) if os.path.isdir(target) else os.unlink(target)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
