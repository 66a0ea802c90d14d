"""Text files as the corpus (issue 25): on the command line a path alone names its source, a
max_bytes the user sets caps what is read (by default all of it), and tokenizing a file costs about
2 bytes per byte of text, not 12."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from ember.data import (ByteTokenizer, DataConfig, build_batches, corpus_note, source_from_path, text_files,
                        tokenize_documents)
from ember.launch import train


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"abcab\n" * 20_000)  # 120 kB of only a, b, c and newline
    return path


@pytest.mark.parametrize("name, source", [("x.txt", "text"), ("x.md", "text"), ("tokens.bin", "bin"), ("docs", "text")])
def test_a_path_alone_names_its_source(tmp_path, name, source):
    assert source_from_path(DataConfig(path=str(tmp_path / name))).source == source
    assert source_from_path(DataConfig(source="text", path=str(tmp_path / name))).source == "text"  # explicit
    assert source_from_path(DataConfig()).source == "stdlib"


def test_a_saved_config_keeps_its_source(tmp_path):
    """A run saved with an ignored path trained on stdlib: restoring its config must not change that."""
    assert DataConfig(path=str(tmp_path / "x.txt")).source == "stdlib"


def test_a_jsonl_path_alone_is_refused():
    with pytest.raises(ValueError, match=r"data.path='chat.jsonl' is JSONL .* pass --data.source sft"):
        source_from_path(DataConfig(path="chat.jsonl"))


def test_train_reads_the_path_without_a_source(corpus, tmp_out, capsys):
    assert list(tmp_out.iterdir()) == []
    train.main(["--data.path", str(corpus), "--steps", "1", "--out", str(tmp_out), "--backend", "eager",
                "--data.batch_size", "2", "--data.seq_len", "16", "--eval_batches", "1", "--sample_tokens", "0",
                "--data.max_bytes", "30000"])
    saved = json.loads((tmp_out / "config.json").read_text())["data"]
    assert (saved["source"], saved["path"]) == ("text", str(corpus))  # was: stdlib, the path ignored
    assert "data: reading the first 0.0 MB of the 0.1 MB at" in capsys.readouterr().out
    cfg = DataConfig(source="text", path=str(corpus), seq_len=16, batch_size=4)
    assert build_batches(cfg, tokenizer=ByteTokenizer(eos=True)).pipeline.config["num_tokens"] == 120_001  # all of it
    batch = next(build_batches(cfg, tokenizer=ByteTokenizer(eos=True)))
    assert set(batch["inputs"].unique().tolist()) <= set(b"abc\n") | {256}


def test_max_bytes_caps_one_file(corpus):
    docs = text_files(corpus, max_bytes=1000)
    assert (docs.total_bytes(), len(docs[0]), docs.unread_bytes) == (1000, 1000, 119_000)
    assert "119000 bytes over max_bytes left unread" in repr(docs)
    tok = ByteTokenizer(eos=True)
    cfg = DataConfig(source="text", path=str(corpus), max_bytes=1000, seq_len=8, batch_size=2)
    it = build_batches(cfg, tokenizer=tok)
    assert it.pipeline.config["num_tokens"] == 1001  # the cap and one EOS; was 120_001
    assert corpus_note(DataConfig(source="text", path=str(corpus), max_bytes=1000)).startswith(
        f"data: reading the first 0.0 MB of the 0.1 MB at {corpus} (--data.max_bytes 1000)")
    assert corpus_note(DataConfig(source="text", path=str(corpus), max_bytes=None)) is None


def test_max_bytes_takes_whole_files_then_the_start_of_the_next(tmp_path):
    for name in "abc":
        (tmp_path / f"{name}.txt").write_text(name * 400)
    docs = text_files(tmp_path, max_bytes=1000)
    assert list(docs) == ["a" * 400, "b" * 400, "c" * 200] and docs.unread_bytes == 200
    assert list(docs[1:]) == ["b" * 400, "c" * 200]
    assert list(text_files(tmp_path, max_bytes=400)) == ["a" * 400]


def test_a_cut_character_is_dropped_and_utf8_reads_match(tmp_path):
    path = tmp_path / "u.txt"
    path.write_bytes("hé😀".encode() + b"\xff!")  # h, é (2 bytes), an emoji (4 bytes), an invalid byte
    for cap in range(1, 10):
        docs = text_files(path, max_bytes=cap)
        assert docs.read_utf8(0) == docs[0].encode()
        assert "\ufffd" not in docs[0] or cap >= 8, (cap, docs[0])  # only the invalid byte, never a cut character
    whole = text_files(path)
    assert whole[0] == "hé😀\ufffd!" and whole.read_utf8(0, chunk_bytes=3) == "hé😀\ufffd!".encode()


def test_tokenizing_a_file_costs_about_two_bytes_per_byte(tmp_path):
    path = tmp_path / "big.txt"
    n = 4_000_000
    path.write_bytes(("x" * 99 + "\n").encode() * (n // 100 - 1) + "😀\n".encode() * 20)  # one emoji: a 4-byte str
    docs = text_files(path)
    tracemalloc.start()
    tokens = tokenize_documents(docs, ByteTokenizer(eos=True))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert tokens.dtype == np.uint16 and tokens.size == docs.total_bytes() + 1
    assert peak < 4.5 * n, f"{peak / n:.1f} bytes per byte"  # was 11: a 4-byte str, int32 ids, copies
