"""nanoGPT-style token files: a raw little-endian array of uint16 or uint32 ids, no header.

Public names:
    TokenBin: a token file opened as a read-only `np.memmap`; pickles by path, so grain worker
        processes reopen the file instead of receiving a copy of the tokens.
    load_token_bin: opens a `.bin` file as a `TokenBin`.
    write_token_bin: writes an array (or an iterable of arrays, streamed) to a `.bin` file.
    token_dtype: the smallest unsigned dtype (uint16 or uint32) that holds a vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = ["TokenBin", "load_token_bin", "token_dtype", "write_token_bin"]

BinDtype = Literal["uint16", "uint32"]
_BIN_DTYPES: tuple[str, ...] = ("uint16", "uint32")


def token_dtype(vocab_size: int) -> np.dtype:
    """Returns uint16 if every id of the vocabulary fits, else uint32.

    Args:
        vocab_size: number of token ids.

    Returns:
        `np.dtype("uint16")` for `vocab_size <= 65536`, else `np.dtype("uint32")`.

    Raises:
        ValueError: if `vocab_size` is not in [1, 2**32].
    """
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}.")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _check_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.name not in _BIN_DTYPES:
        raise ValueError(f"dtype must be one of {list(_BIN_DTYPES)} for a token .bin file, got {dt.name!r}.")
    return dt.newbyteorder("<")


class TokenBin:
    """A token file mapped read-only into memory.

    Supports `len`, integer and slice indexing (numpy results) and `np.asarray(token_bin)`.

    Args:
        path: the `.bin` file.
        dtype: "uint16" (nanoGPT's default) or "uint32"; the file has no header, so this must
            match how it was written.

    Raises:
        FileNotFoundError: if `path` does not exist.
        ValueError: for another dtype, or a file size that is not a multiple of the item size.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "toks.bin")
        >>> _ = write_token_bin(path, np.arange(10))
        >>> TokenBin(path)[2:5].tolist()
        [2, 3, 4]
    """

    def __init__(self, path: str | os.PathLike, *, dtype: BinDtype = "uint16") -> None:
        self.path = Path(path).absolute()
        self.dtype = _check_dtype(dtype)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"token file {str(path)!r} does not exist; expected a raw {self.dtype.name} .bin file "
                f"written by write_token_bin (or nanoGPT's prepare.py)."
            )
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise ValueError(
                f"token file {str(path)!r} has {size} bytes, not a multiple of {self.dtype.itemsize} "
                f"({self.dtype.name}); was it written with another dtype?"
            )
        self._array: np.memmap | None = None

    @property
    def array(self) -> np.ndarray:
        """The whole file as a read-only 1-D memmap (opened on first use)."""
        if self._array is None:
            if self.path.stat().st_size == 0:
                self._array = np.zeros((0,), dtype=self.dtype)  # np.memmap refuses empty files
            else:
                self._array = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._array

    def __len__(self) -> int:
        return self.path.stat().st_size // self.dtype.itemsize

    def __getitem__(self, index: Any) -> Any:
        return self.array[index]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.array
        return arr if dtype is None else arr.astype(dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), "dtype": self.dtype.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = Path(state["path"])
        self.dtype = _check_dtype(state["dtype"])
        self._array = None

    def __repr__(self) -> str:
        return f"TokenBin({str(self.path)!r}, dtype={self.dtype.name!r}, tokens={len(self)})"


def load_token_bin(path: str | os.PathLike, *, dtype: BinDtype = "uint16") -> TokenBin:
    """Opens a nanoGPT-style token file.

    Args:
        path: the `.bin` file.
        dtype: "uint16" or "uint32", as written.

    Returns:
        A `TokenBin`.

    Raises:
        FileNotFoundError: if `path` does not exist.
        ValueError: for a bad dtype or file size.
    """
    return TokenBin(path, dtype=dtype)


def write_token_bin(
    path: str | os.PathLike,
    tokens: np.ndarray | Iterable[np.ndarray],
    *,
    dtype: BinDtype | None = None,
) -> int:
    """Writes token ids to a raw `.bin` file (atomically: a temporary file, then a rename).

    Args:
        path: the file to write; parent directories are created.
        tokens: one array of ids, or an iterable of arrays written one after another (for corpora
            larger than memory).
        dtype: "uint16" or "uint32"; None means uint16, which every id must then fit.

    Returns:
        The number of tokens written.

    Raises:
        ValueError: if an id is negative or does not fit the dtype.

    Example:
        >>> import tempfile, os
        >>> write_token_bin(os.path.join(tempfile.mkdtemp(), "t.bin"), [np.arange(3), np.arange(4)])
        7
    """
    dt = _check_dtype(dtype or "uint16")
    limit = np.iinfo(dt).max
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    chunks = [tokens] if isinstance(tokens, np.ndarray) else tokens
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                arr = np.asarray(chunk).reshape(-1)
                if arr.size and (arr.min() < 0 or arr.max() > limit):
                    raise ValueError(
                        f"token ids must be in [0, {limit}] for dtype {dt.name}, got range "
                        f"[{arr.min()}, {arr.max()}]; pass dtype='uint32' for vocabularies over 65536."
                    )
                f.write(arr.astype(dt, copy=False).tobytes())
                n += arr.size
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return n
