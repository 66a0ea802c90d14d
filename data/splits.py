"""Deterministic train/eval split of documents by a hash of their name.

Public names:
    Split: `Literal["train", "eval", "all"]`.
    SPLITS: the valid split names.
    split_of: which split ("train" or "eval") a document name belongs to.
    check_split: validates a split name, listing the valid ones.

Hashing the name (not the position) keeps a file in the same split when other files are added
or removed, on every machine and Python version (sha256, not the salted built-in `hash`).
"""

from __future__ import annotations

import hashlib
from typing import Literal

__all__ = ["SPLITS", "Split", "check_split", "split_of"]

Split = Literal["train", "eval", "all"]
SPLITS: tuple[str, ...] = ("train", "eval", "all")


def check_split(split: str, *, eval_fraction: float) -> None:
    """Validates a split name and eval fraction.

    Args:
        split: one of `SPLITS`.
        eval_fraction: the share of documents in "eval", in [0, 1].

    Raises:
        ValueError: listing the valid choices or the valid range.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}.")
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}.")


def split_of(name: str, *, eval_fraction: float) -> Literal["train", "eval"]:
    """Assigns a document to "train" or "eval" from a hash of its name.

    Args:
        name: a stable document name, such as a path relative to the corpus root (use "/").
        eval_fraction: the expected share of documents that land in "eval".

    Returns:
        "eval" for about `eval_fraction` of all names, "train" for the rest.

    Example:
        >>> split_of("json/decoder.py", eval_fraction=0.0)
        'train'
    """
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64  # uniform in [0, 1)
    return "eval" if u < eval_fraction else "train"
