"""The tokenizer protocol and a byte-level tokenizer that needs no training.

Public names:
    Tokenizer: the small protocol every ember tokenizer follows (`vocab_size`, `eos_id`,
        `encode`, `decode`).
    ByteTokenizer: UTF-8 bytes as tokens 0..255, plus optional special tokens from 256 up.
    as_token_ids: turn a list / numpy array / torch tensor of ids into a 1-D int64 numpy array.

A trained byte-level BPE lives in `ember.data.bpe` (`train_bpe`, `BPETokenizer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["ByteTokenizer", "Tokenizer", "as_token_ids"]

EOS_TOKEN = "<|endoftext|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer.

    Attributes:
        vocab_size: number of ids; every id `encode` returns is in `[0, vocab_size)`.
        eos_id: the id placed between documents in a token stream, or None if the tokenizer
            has no end-of-text token (documents are then concatenated with no separator).
    """

    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray:
        """Encodes `text` into a 1-D int32 array of token ids (no special tokens added)."""
        ...

    def decode(self, ids: Any) -> str:
        """Decodes a sequence of ids (list, numpy array or torch tensor) back to text."""
        ...


def as_token_ids(ids: Any, *, name: str = "ids") -> np.ndarray:
    """Converts token ids in any common container to a 1-D int64 numpy array.

    Args:
        ids: a list / tuple of ints, a numpy array, or a torch tensor (moved to CPU), 0-d or 1-D.
        name: how to call `ids` in error messages.

    Returns:
        A 1-D int64 numpy array.

    Raises:
        TypeError: if the ids are not integers.
        ValueError: if the ids have more than one dimension.

    Example:
        >>> as_token_ids([104, 105]).tolist()
        [104, 105]
    """
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # a torch tensor, without importing torch
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros((0,), dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids, got dtype {arr.dtype}; pass ints.")
    if arr.ndim > 1:
        raise ValueError(
            f"{name} must be 0-d or 1-D, got shape {arr.shape}; decode one sequence at a time "
            f"(for a batch: [tok.decode(row) for row in batch])."
        )
    return arr.reshape(-1).astype(np.int64, copy=False)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, with optional special tokens numbered from 256.

    Encoding never produces special tokens: text containing `"<|endoftext|>"` is encoded as its
    bytes. Decoding renders special ids as their names (unless `skip_special_tokens=True`) and
    replaces invalid UTF-8 (for example a multi-byte character cut in half) with U+FFFD.

    Args:
        eos: add the end-of-text token `"<|endoftext|>"` as id 256.
        special_tokens: further special token names, numbered after EOS.

    Raises:
        ValueError: if a special token name is repeated or empty.

    Example:
        >>> tok = ByteTokenizer(eos=True)
        >>> tok.vocab_size, tok.eos_id
        (257, 256)
        >>> tok.decode(tok.encode("héllo"))
        'héllo'
    """

    def __init__(self, *, eos: bool = False, special_tokens: Sequence[str] = ()) -> None:
        names = ([EOS_TOKEN] if eos else []) + list(special_tokens)
        if any(not isinstance(n, str) or not n for n in names):
            raise ValueError(f"special_tokens must be non-empty strings, got {list(special_tokens)!r}.")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"special token names must be unique, got {dupes} more than once "
                f"(eos={eos} already adds {EOS_TOKEN!r})."
            )
        self.special_tokens: dict[str, int] = {n: 256 + i for i, n in enumerate(names)}
        self._special_names: dict[int, str] = {i: n for n, i in self.special_tokens.items()}
        self.vocab_size: int = 256 + len(names)
        self.eos_id: int | None = self.special_tokens.get(EOS_TOKEN)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    def encode(self, text: str) -> np.ndarray:
        """Encodes text as its UTF-8 bytes.

        Args:
            text: any string.

        Returns:
            A 1-D int32 array with one id per UTF-8 byte.

        Raises:
            TypeError: if `text` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}; decode bytes first.")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Any, *, skip_special_tokens: bool = False) -> str:
        """Decodes ids back to text.

        Args:
            ids: 1-D ids (list, numpy array or torch tensor).
            skip_special_tokens: drop special ids instead of rendering their names.

        Returns:
            The decoded string; invalid UTF-8 becomes U+FFFD.

        Raises:
            ValueError: if an id is outside `[0, vocab_size)`.
        """
        arr = as_token_ids(ids)
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise ValueError(
                f"ids must be in [0, {self.vocab_size}) for {self!r}, got {bad[:5].tolist()}; "
                f"were they produced by a different tokenizer?"
            )
        if not self._special_names:
            return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        parts: list[str] = []
        is_special = arr >= 256
        start = 0
        for pos in np.flatnonzero(is_special).tolist() + [arr.size]:
            parts.append(arr[start:pos].astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
            if pos < arr.size and not skip_special_tokens:
                parts.append(self._special_names[int(arr[pos])])
            start = pos + 1
        return "".join(parts)
