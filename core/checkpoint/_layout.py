"""The checkpoint directory on disk: step folders, orbax's temporary folders, foreign content.

Private module of `ember.core.checkpoint`. orbax writes step `N` into `DIR/N.orbax-checkpoint-tmp`
and renames it to `DIR/N` once every file is written (the atomic commit); any folder whose name is
a number counts as a step to orbax, and pruning (`max_to_keep`) deletes steps. These checks run
before orbax touches a directory, so a mistyped path never loses a user's files.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import List

from ._meta import CheckpointError

__all__ = ["check_root", "describe_contents", "disk_bytes", "is_step_name", "step_dir", "temporary_dirs"]

TMP_MARKER = ".orbax-checkpoint-tmp"  # orbax's suffix for a step being written
META_ITEM = "meta"
_STEP_NAME = re.compile(r"^(0|[1-9]\d*)$")  # orbax's default step folder names
# What a (possibly half-pruned) step folder written by orbax contains.
_STEP_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt", META_ITEM, "state", "params", "data", "metrics")


def is_step_name(name: str) -> bool:
    """True if orbax reads a folder called `name` as a step."""
    return bool(_STEP_NAME.match(name))


def step_dir(directory: pathlib.Path, step: int) -> pathlib.Path:
    """The folder of a committed step."""
    return directory / str(step)


def temporary_dirs(directory: pathlib.Path) -> List[str]:
    """Names of orbax's unfinished step folders (a save that never committed)."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if TMP_MARKER in p.name)


def describe_contents(directory: pathlib.Path, *, limit: int = 6) -> str:
    """`"a.txt, logs/, ... (12 entries)"`, or `"nothing"`."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    if not names:
        return "nothing"
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} entries)" if len(names) > limit else "")


def disk_bytes(path: pathlib.Path) -> int:
    """Total size of the files under `path`."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:  # deleted while walking (pruning in another process)
                pass
    return total


def _looks_like_step(path: pathlib.Path) -> bool:
    return (path / "_CHECKPOINT_METADATA").is_file() or (
        (path / META_ITEM).is_dir() and (path / "commit_success.txt").is_file()
    )


def check_root(directory: pathlib.Path, *, writing: bool) -> None:
    """Refuse a checkpoint root that is a file, a single step, missing (reading), or holds
    number-named folders that are not checkpoints (writing: orbax's pruning could delete them).

    Raises:
        CheckpointError: naming the directory, what was found and what to pass instead.
    """
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} is a file; pass a directory (e.g. {directory.parent}/checkpoints).")
    if not directory.exists():
        if writing:
            return
        raise CheckpointError(f"checkpoint directory {directory} does not exist; pass the folder a run saved into (e.g. OUT/checkpoints).")
    if _looks_like_step(directory):
        raise CheckpointError(
            f"{directory} is one saved step, not a checkpoint directory; pass its parent, {directory.parent}, "
            f"and choose the step with step={directory.name}."
        )
    if not writing:
        return
    foreign = []
    for p in directory.iterdir():
        if p.is_dir() and is_step_name(p.name) and any(p.iterdir()):
            if not any((p / m).exists() for m in _STEP_MARKERS):
                foreign.append(p.name)
    if foreign:
        raise CheckpointError(
            f"{directory} holds folders named like checkpoint steps that are not checkpoints: "
            f"{', '.join(sorted(foreign, key=int))}. orbax would count them as steps and could delete them "
            f"when pruning old checkpoints, so nothing was written. Use a dedicated directory, e.g. "
            f"{directory / 'checkpoints'}."
        )
