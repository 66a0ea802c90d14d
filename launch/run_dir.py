"""A run directory (`--out`) as a unit of work: one process at a time, and nothing of an earlier run lost.

    with claim_run_directory(cfg.out, resume=args.resume, overwrite=args.overwrite):
        ...train, write metrics, checkpoints, the plot...

A lock file `OUT/.ember.lock` holds the PID and host of the process using the directory; a second
process is refused at once, naming that PID. A lock left by a process that no longer runs (on this
host) is taken over with a notice. A fresh run into a directory that already holds a run's files is
refused unless `--resume` (continue it) or `--overwrite` (replace it: only the files a run writes
are removed). The folders a run made are removed again when it ends with no file in them (a run that
failed before writing leaves no empty `--out`); an `--out` that is a file or cannot be written is
refused with one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
from typing import Iterator, List, Optional, Set

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


def _unusable(out: str, error: OSError) -> RunDirectoryError:
    """The one-line refusal of an `--out` that is a file (or lies under one) or cannot be written."""
    if error.errno in (errno.EEXIST, errno.ENOTDIR):
        path = os.path.abspath(out)
        while not os.path.isfile(path) and path != os.path.dirname(path):
            path = os.path.dirname(path)
        where = f"{out} is a file" if path == os.path.abspath(out) else f"{out}: {path} is a file"
        return RunDirectoryError(f"--out {where}, not a directory; pass --out a directory path (e.g. runs/NAME).")
    return RunDirectoryError(f"--out {out} cannot be written ({error.strerror or error}); pass --out a directory "
                             f"you can write to (e.g. runs/NAME), or make it writable.")


def _make_directory(out: str) -> List[str]:
    """Create `out` and its missing parents; the folders created, deepest first."""
    created, path = [], os.path.abspath(out)
    while path and not os.path.exists(path) and path != os.path.dirname(path):
        created.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as error:
        _remove_empty(out, set(), created)
        raise _unusable(out, error) from None
    return created


def _remove_empty(out: str, before: Set[str], created: List[str]) -> None:
    """Remove the folders this run made that hold no file (an empty `checkpoints/`): new entries of `out`
    (not in `before`), then `out` and its parents if this run created them (`created`, deepest first)."""
    new = set(os.listdir(out)) - before if os.path.isdir(out) else set()
    for path in (os.path.join(out, name) for name in sorted(new)):
        if os.path.isdir(path) and not os.path.islink(path):
            for root, dirs, _ in os.walk(path, topdown=False):
                for name in dirs:
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(root, name))
            with contextlib.suppress(OSError):
                os.rmdir(path)  # refuses a folder that holds anything
    for path in created:
        try:
            os.rmdir(path)
        except OSError:
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _create_with(path: str, text: str) -> None:
    """Create `path` holding `text` in one step, or raise FileExistsError: the text is written to a private
    file first and hard-linked into place, so no other process ever reads the lock empty."""
    private = f"{path}.{os.getpid()}"
    with open(private, "w") as f:
        f.write(text + "\n")
    try:
        os.link(private, path)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: create exclusively, then write
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
    finally:
        os.unlink(private)


def _take_lock(out: str, say) -> str:
    path = os.path.join(out, LOCK_FILE)
    me = f"{os.getpid()} {socket.gethostname()}"
    for _ in range(2):
        try:
            _create_with(path, me)
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
        except OSError as error:  # a read-only directory or file system
            raise _unusable(out, error) from None
        return path
    raise RunDirectoryError(f"could not take the lock {path}; another process is starting in {out}.")


@contextlib.contextmanager
def claim_run_directory(out: Optional[str], *, resume: bool, overwrite: bool = False, say=print) -> Iterator[None]:
    """Hold `out` for this run: lock it, refuse to overwrite an earlier run, release on exit.

    Raises:
        RunDirectoryError: another live process holds `out`; or `out` holds an earlier run's files and
            neither `resume` nor `overwrite` is set (names the files and both flags); or `out` is a file
            or cannot be written.
    """
    if out is None:
        yield
        return
    created = _make_directory(out)
    try:
        lock = _take_lock(out, say)
    except BaseException:
        _remove_empty(out, set(), created)
        raise
    before = set(os.listdir(out))
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
                before.discard(name)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        _remove_empty(out, before, created)  # a run that wrote nothing leaves no empty folders behind
