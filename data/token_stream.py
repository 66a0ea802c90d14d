"""Tokenizes documents into one token stream, documents separated by EOS.

Public names:
    tokenize_documents: encodes an iterable of strings into one 1-D uint16 / uint32 array.
    iter_document_tokens: the same, yielded per document (to stream into `write_token_bin`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from .token_bin import token_dtype
from .tokenizers import Tokenizer

__all__ = ["iter_document_tokens", "tokenize_documents"]

_BATCH = 256  # documents per encode_batch call, for tokenizers that have one


def _check_tokenizer(tokenizer: object) -> None:
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"tokenizer must follow ember.data.Tokenizer (vocab_size, eos_id, encode, decode), got "
            f"{type(tokenizer).__name__}; use ByteTokenizer(eos=True) or train_bpe(...)."
        )


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
    eos = np.asarray([tokenizer.eos_id], dtype=np.int32) if append_eos and tokenizer.eos_id is not None else None
    encode_batch = getattr(tokenizer, "encode_batch", None)

    def finish(ids: np.ndarray) -> np.ndarray:
        return np.concatenate([ids, eos]) if eos is not None else ids

    if encode_batch is None:
        for doc in docs:
            yield finish(tokenizer.encode(doc))
        return
    pending: list[str] = []
    for doc in docs:
        if not isinstance(doc, str):
            raise TypeError(f"documents must be str, got {type(doc).__name__}.")
        pending.append(doc)
        if len(pending) == _BATCH:
            yield from (finish(ids) for ids in encode_batch(pending))
            pending = []
    if pending:
        yield from (finish(ids) for ids in encode_batch(pending))


def tokenize_documents(
    docs: Iterable[str],
    tokenizer: Tokenizer,
    *,
    append_eos: bool = True,
    dtype: np.dtype | str | None = None,
) -> np.ndarray:
    """Encodes documents and concatenates them into one token stream.

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
    parts = [ids.astype(dt, copy=False) for ids in iter_document_tokens(docs, tokenizer, append_eos=append_eos)]
    return np.concatenate(parts) if parts else np.zeros((0,), dtype=dt)
