"""Opens a data source from one string, as a config file or command line would name it.

Public names:
    load_source: `"stdlib"` -> `stdlib_corpus`, `*.bin` -> `load_token_bin`, a directory written by
        `datasets.save_to_disk` -> `hf_text_from_disk`, any other file / directory / glob ->
        `text_files`.

The loaders themselves live in `stdlib_corpus.py`, `token_bin.py`, `hf_disk.py` and
`text_files.py`; call them directly for their full options.
"""

from __future__ import annotations

import glob as _glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .hf_disk import hf_text_from_disk
from .splits import Split
from .stdlib_corpus import stdlib_corpus
from .text_files import text_files
from .token_bin import BinDtype, load_token_bin

__all__ = ["check_source_kind", "load_source", "source_kind"]

# Files `save_to_disk` writes: a Dataset has state.json + dataset_info.json, a DatasetDict has dataset_dict.json.
_HF_MARKERS = ("dataset_dict.json", "state.json")


def source_kind(path: str | os.PathLike) -> str:
    """What `load_source` reads `path` as: "bin" (a `.bin` token file), "hf" (a `save_to_disk`
    directory) or "text" (a text file, directory or glob)."""
    p = Path(path)
    if p.suffix == ".bin" and not p.is_dir():
        return "bin"
    if p.is_dir() and any((p / m).is_file() for m in _HF_MARKERS):
        return "hf"
    return "text"


def check_source_kind(source: str, path: str | os.PathLike) -> None:
    """Raise ValueError when `path` is not what `source` ("text", "bin", "hf") says, naming the right one."""
    kind = source_kind(path)
    if kind != source:
        what = {"bin": "a .bin token file", "hf": "a Hugging Face dataset saved to disk", "text": "text"}
        if source == "bin" and kind == "text" and _is_binary(path):
            raise ValueError(f"data.source='bin' reads a token file named *.bin, but data.path={os.fspath(path)!r} "
                             f"is a binary file with another name (the file name decides: .bin means tokens); if it "
                             f"holds raw uint16 token ids, name it {Path(path).stem}.bin, else point --data.path at one.")
        raise ValueError(f"data.source={source!r} but data.path={os.fspath(path)!r} is {what[kind]} (the file name "
                         f"decides: .bin means tokens); pass --data.source {kind}, or a path of {what[source]}.")


def _is_binary(path: str | os.PathLike, sniff_bytes: int = 8192) -> bool:
    """True if `path` is a file with a NUL byte in its first `sniff_bytes` (as `TextFiles.check_text` sniffs)."""
    if not Path(path).is_file():
        return False
    with open(path, "rb") as f:
        return b"\0" in f.read(sniff_bytes)


def load_source(
    spec: str | os.PathLike,
    *,
    split: Split = "train",
    max_bytes: int | None = None,
    bin_dtype: BinDtype = "uint16",
    field: str = "text",
    pattern: str = "**/*.txt",
) -> Sequence[str] | Any:
    """Opens the data source named by `spec`.

    Args:
        spec: `"stdlib"` (the embedded default corpus), a `.bin` token file, a Hugging Face
            dataset directory, or a text file / directory / glob.
        split: for "stdlib": "train", "eval" or "all"; for a Hugging Face `DatasetDict`: the split
            name ("all" is not valid there).
        max_bytes: for "stdlib" and text: cap on the bytes read (see `stdlib_corpus`, `TextFiles`).
        bin_dtype: for `.bin` files: "uint16" or "uint32".
        field: for Hugging Face datasets: the text column.
        pattern: for a directory of text files: the glob inside it.

    Returns:
        Documents (`TextFiles`, `HFTextColumn`) or tokens (`TokenBin`), ready for `make_pipeline`.

    Raises:
        FileNotFoundError: if the path does not exist (the message lists what `spec` may be).
        ValueError: text files that are empty or binary.

    Example:
        >>> docs = load_source("stdlib", max_bytes=10_000)
        >>> len(docs) > 0
        True
    """
    s = os.fspath(spec)
    if s == "stdlib":
        return stdlib_corpus(split=split, max_bytes=max_bytes)
    p = Path(s)
    if p.suffix == ".bin" and not p.is_dir():
        return load_token_bin(p, dtype=bin_dtype)
    if p.is_dir() and any((p / m).is_file() for m in _HF_MARKERS):
        return hf_text_from_disk(p, split=None if (p / "state.json").is_file() else split, field=field)
    if p.exists() or _glob.has_magic(s):
        docs = text_files(p, pattern=pattern, max_bytes=max_bytes)
        docs.check_text()
        return docs
    raise FileNotFoundError(
        f"data source {s!r} does not exist; expected 'stdlib', a .bin token file, a directory written "
        f"by datasets' save_to_disk, or a text file / directory / glob."
    )
