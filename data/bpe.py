"""A byte-level BPE tokenizer trained locally with Hugging Face `tokenizers`.

Public names:
    BPETokenizer: wraps a `tokenizers.Tokenizer` in ember's `Tokenizer` protocol; `save` / `load`
        to one JSON file.
    train_bpe: trains a byte-level BPE (GPT-2 style pre-tokenizer, every byte in the base
        alphabet, so any text encodes without unknown tokens) on an iterable of strings.
    bytes_as_bpe: a `ByteTokenizer`'s ids as a BPE without merges, so `save` writes a `tokenizer.json`
        that `transformers` loads (`ckpt.py export --hf` of a byte-tokenizer run).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tokenizers as hf_tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from .tokenizers import EOS_TOKEN, ByteTokenizer, as_token_ids

__all__ = ["BPETokenizer", "bytes_as_bpe", "train_bpe"]


class BPETokenizer:
    """ember's tokenizer protocol over a Hugging Face `tokenizers.Tokenizer`.

    Args:
        tokenizer: a `tokenizers.Tokenizer` (for example from `train_bpe` or `tokenizer.json`).
        eos_token: the name of the end-of-text token; `eos_id` is None if it is not in the vocab.

    Example:
        >>> tok = train_bpe(["hello world"] * 10, vocab_size=300)
        >>> tok.decode(tok.encode("hello world"))
        'hello world'
    """

    def __init__(self, tokenizer: hf_tokenizers.Tokenizer, *, eos_token: str = EOS_TOKEN) -> None:
        if not isinstance(tokenizer, hf_tokenizers.Tokenizer):
            raise TypeError(
                f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}; "
                f"for a saved file use BPETokenizer.load(path)."
            )
        self.tokenizer = tokenizer
        self.eos_token = eos_token
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = tokenizer.token_to_id(eos_token)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    def encode(self, text: str) -> np.ndarray:
        """Encodes text (no special tokens added).

        Args:
            text: any string.

        Returns:
            A 1-D int32 array of ids.

        Raises:
            TypeError: if `text` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}.")
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encodes many texts at once (parallel inside `tokenizers`).

        Args:
            texts: strings to encode.

        Returns:
            One 1-D int32 array per text.
        """
        encs = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids: Any, *, skip_special_tokens: bool = False) -> str:
        """Decodes ids back to text.

        Args:
            ids: 1-D ids (list, numpy array or torch tensor).
            skip_special_tokens: drop special tokens such as EOS from the text.

        Returns:
            The decoded string.

        Raises:
            ValueError: if an id is outside `[0, vocab_size)`.
        """
        arr = as_token_ids(ids)
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"ids must be in [0, {self.vocab_size}) for {self!r}, got {bad[:5].tolist()}.")
        return self.tokenizer.decode(arr.tolist(), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the tokenizer to one JSON file (the Hugging Face `tokenizer.json` format).

        Args:
            path: the file to write; its parent directory must exist.
        """
        self.tokenizer.save(os.fspath(path))

    @classmethod
    def load(cls, path: str | os.PathLike, *, eos_token: str = EOS_TOKEN) -> BPETokenizer:
        """Reads a tokenizer written by `save` (or any Hugging Face `tokenizer.json`).

        Args:
            path: the JSON file.
            eos_token: the name of the end-of-text token.

        Returns:
            The tokenizer.

        Raises:
            FileNotFoundError: if `path` does not exist.
        """
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"tokenizer file {os.fspath(path)!r} does not exist; expected a JSON file written by "
                f"BPETokenizer.save (or a Hugging Face tokenizer.json)."
            )
        return cls(hf_tokenizers.Tokenizer.from_file(os.fspath(path)), eos_token=eos_token)


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = (EOS_TOKEN,),
    show_progress: bool = False,
) -> BPETokenizer:
    """Trains a byte-level BPE tokenizer on local text.

    The base alphabet holds all 256 byte symbols, so the vocabulary is at least
    `256 + len(special_tokens)` and any string encodes without unknown tokens.

    Args:
        texts: the training text, one string per document (any iterable, read once).
        vocab_size: the target vocabulary size, special tokens included.
        min_frequency: a pair must occur this often to be merged.
        special_tokens: special token names; the first ones get the lowest ids after training
            (`"<|endoftext|>"` is the EOS token).
        show_progress: show the `tokenizers` progress bar.

    Returns:
        The trained `BPETokenizer`.

    Raises:
        ValueError: if `vocab_size` is smaller than the byte alphabet plus the special tokens.

    Example:
        >>> tok = train_bpe(["def f(x):\\n    return x\\n"] * 50, vocab_size=280)
        >>> tok.eos_id
        0
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    need = len(alphabet) + len(special_tokens)
    if vocab_size < need:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte alphabet has {len(alphabet)} symbols and "
            f"there are {len(special_tokens)} special tokens, so at least {need} ids are needed."
        )
    tok = hf_tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=alphabet,
        show_progress=show_progress,
    )
    tok.train_from_iterator(iter(texts), trainer=trainer)
    eos = EOS_TOKEN if EOS_TOKEN in special_tokens else (special_tokens[0] if special_tokens else EOS_TOKEN)
    return BPETokenizer(tok, eos_token=eos)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value (what the ByteLevel pre-tokenizer emits), by value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    moved = iter(range(256, 512))
    return [chr(b if b in keep else next(moved)) for b in range(256)]


def bytes_as_bpe(tokenizer: ByteTokenizer) -> BPETokenizer:
    """`tokenizer`'s ids as a byte-level BPE without merges: byte `b` is id `b`, its special tokens keep theirs.

    `save` then writes a `tokenizer.json` that `tokenizers` and `transformers` load and that encodes text
    to the same ids (a special token's name in the text becomes its id there, its bytes here).

    Example:
        >>> tok = ByteTokenizer(eos=True)
        >>> bpe = bytes_as_bpe(tok)
        >>> bpe.encode("héllo").tolist() == tok.encode("héllo").tolist(), bpe.eos_id, bpe.vocab_size
        (True, 256, 257)
    """
    symbols = _byte_symbols()
    hf = hf_tokenizers.Tokenizer(models.BPE(vocab={s: b for b, s in enumerate(symbols)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get))
    return BPETokenizer(hf, eos_token=EOS_TOKEN)
