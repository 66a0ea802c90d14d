"""Tokenizes documents into one token stream, documents separated by EOS.

Public names:
    tokenize_documents: encodes an iterable of strings into one 1-D uint16 / uint32 array.
    iter_document_tokens: the same, yielded per document (to stream into `write_token_bin`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from .token_bin import token_dtype
from .text_files import TextFiles
from .tokenizers import ByteTokenizer, Tokenizer

__all__ = ["iter_document_tokens", "tokenize_documents"]

_BATCH = 256  # documents per encode_batch call, for tokenizers that have one


def _check_tokenizer(tokenizer: object) -> None:
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"tokenizer must follow ember.data.Tokenizer (vocab_size, eos_id, encode, decode), got "
            f"{type(tokenizer).__name__}; use ByteTokenizer(eos=True) or train_bpe(...)."
        )


def _strings(docs: Iterable[str]) -> Iterator[str]:
    for doc in docs:
        if not isinstance(doc, str):
            raise TypeError(f"documents must be str, got {type(doc).__name__}.")
        yield doc


def _encoded(docs: Iterable[str], tokenizer: Tokenizer) -> Iterator[np.ndarray]:
    """Each document's ids, no EOS; a `ByteTokenizer`'s as uint8 (its UTF-8 bytes, not 4-byte ints)."""
    encode_batch = getattr(tokenizer, "encode_batch", None)
    if isinstance(tokenizer, ByteTokenizer) and isinstance(docs, TextFiles):  # files: never a whole-file str
        for i in range(len(docs)):
            yield np.frombuffer(docs.read_utf8(i), dtype=np.uint8)
        return
    if isinstance(tokenizer, ByteTokenizer):  # the same ids as its encode(), without its int32 copy
        for doc in _strings(docs):
            yield np.frombuffer(doc.encode("utf-8"), dtype=np.uint8)
        return
    if encode_batch is None:
        for doc in docs:
            yield tokenizer.encode(doc)
        return
    pending: list[str] = []
    for doc in _strings(docs):
        pending.append(doc)
        if len(pending) == _BATCH:
            yield from encode_batch(pending)
            pending = []
    if pending:
        yield from encode_batch(pending)


def iter_document_tokens(docs: Iterable[str], tokenizer: Tokenizer, *, append_eos: bool = True) -> Iterator[np.ndarray]:
    """Yields each document's token ids, followed by EOS when the tokenizer has one.

    Args:
        docs: documents (strings).
        tokenizer: any `Tokenizer`; `encode_batch` is used when present.
        append_eos: end every document with `tokenizer.eos_id` (skipped if it is None).

    Yields:
        1-D int arrays, one per document (EOS included).

    Raises:
        TypeError: if `tokenizer` does not follow the protocol or a document is not a string.
    """
    _check_tokenizer(tokenizer)
    eos = tokenizer.eos_id if append_eos else None
    for ids in _encoded(docs, tokenizer):
        yield ids.astype(np.int32) if eos is None else np.concatenate([ids, np.asarray([eos], dtype=np.int32)])


def tokenize_documents(
    docs: Iterable[str],
    tokenizer: Tokenizer,
    *,
    append_eos: bool = True,
    dtype: np.dtype | str | None = None,
) -> np.ndarray:
    """Encodes documents and concatenates them into one token stream.

    Memory: about 2 bytes per token for the stream (uint16), plus one document's text and ids at a
    time while encoding, plus the stream again while the documents are joined (more than one).

    Args:
        docs: documents (strings), for example `stdlib_corpus()` or `text_files(...)`.
        tokenizer: any `Tokenizer`.
        append_eos: end every document with `tokenizer.eos_id` (skipped if it is None).
        dtype: the stream's dtype; None picks uint16 or uint32 from `tokenizer.vocab_size`.

    Returns:
        A 1-D array of all ids, in document order.

    Raises:
        TypeError: if `tokenizer` does not follow the protocol.

    Example:
        >>> from ember.data.tokenizers import ByteTokenizer
        >>> tokenize_documents(["ab", "c"], ByteTokenizer(eos=True)).tolist()
        [97, 98, 256, 99, 256]
    """
    _check_tokenizer(tokenizer)
    dt = np.dtype(dtype) if dtype is not None else token_dtype(tokenizer.vocab_size)
    eos = tokenizer.eos_id if append_eos else None
    parts = []
    for ids in _encoded(docs, tokenizer):  # each document straight into the stream's dtype, EOS included
        part = np.empty(len(ids) + (eos is not None), dtype=dt)
        part[:len(ids)] = ids
        if eos is not None:
            part[-1] = eos
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros((0,), dtype=dt)
