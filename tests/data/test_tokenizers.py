"""Tokenizers: ByteTokenizer, trained byte-level BPE, the shared protocol."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.data import BPETokenizer, ByteTokenizer, Tokenizer, train_bpe

UNICODE = "héllo wörld — 日本語 🐍\n\ttabs & <|endoftext|>"


def test_byte_tokenizer_unicode_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ids.tolist() == list(UNICODE.encode("utf-8"))
    assert tok.decode(ids) == UNICODE
    assert tok.decode(ids.tolist()) == UNICODE
    assert tok.decode(torch.from_numpy(ids)) == UNICODE
    assert (tok.vocab_size, tok.eos_id) == (256, None)


def test_byte_tokenizer_special_tokens():
    tok = ByteTokenizer(eos=True, special_tokens=("<pad>",))
    assert (tok.vocab_size, tok.eos_id, tok.special_tokens["<pad>"]) == (258, 256, 257)
    ids = np.concatenate([tok.encode("a"), [256], tok.encode("é"), [257]])
    assert tok.decode(ids) == "a<|endoftext|>é<pad>"
    assert tok.decode(ids, skip_special_tokens=True) == "aé"
    # special token text in the input is plain bytes, never the special id
    assert 256 not in tok.encode("<|endoftext|>").tolist()
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_errors():
    tok = ByteTokenizer(eos=True)
    with pytest.raises(ValueError, match=r"ids must be in \[0, 257\).*\[300\]"):
        tok.decode([97, 300])
    with pytest.raises(ValueError, match="must be unique"):
        ByteTokenizer(eos=True, special_tokens=("<|endoftext|>",))
    with pytest.raises(TypeError, match="text must be str"):
        tok.encode(b"bytes")
    with pytest.raises(TypeError, match="integer token ids"):
        tok.decode(np.array([1.5]))


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    text = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n    y: int = 0\n"] * 30
    return train_bpe(text, vocab_size=300)


def test_bpe_train_encode_decode_round_trip(bpe):
    assert isinstance(bpe, Tokenizer)
    assert 257 < bpe.vocab_size <= 300  # training stops early once no pair reaches min_frequency
    assert bpe.eos_id == 0
    src = "def add(a, b):\n    return a + b\n"
    ids = bpe.encode(src)
    assert ids.dtype == np.int32
    assert len(ids) < len(src.encode())  # merges were learned
    assert bpe.decode(ids) == src
    assert bpe.decode(bpe.encode(UNICODE)) == UNICODE  # unseen bytes still encode (byte alphabet)
    assert [a.tolist() for a in bpe.encode_batch([src, "x"])] == [ids.tolist(), bpe.encode("x").tolist()]


def test_bpe_save_load(bpe, tmp_path):
    path = tmp_path / "tok.json"
    bpe.save(path)
    loaded = BPETokenizer.load(path)
    assert (loaded.vocab_size, loaded.eos_id) == (bpe.vocab_size, bpe.eos_id)
    assert loaded.encode(UNICODE).tolist() == bpe.encode(UNICODE).tolist()
    with pytest.raises(FileNotFoundError, match=r"missing.json.*does not exist"):
        BPETokenizer.load(tmp_path / "missing.json")


def test_bpe_vocab_too_small():
    with pytest.raises(ValueError, match=r"vocab_size=100 is too small.*at least 257"):
        train_bpe(["x"], vocab_size=100)
