"""nanoGPT-style token .bin memmaps: writer, reader, pipeline input."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ember.data import (
    TokenBin,
    load_source,
    load_token_bin,
    make_pipeline,
    token_dtype,
    write_token_bin,
)


@pytest.mark.parametrize("dtype,high", [("uint16", 65_535), ("uint32", 1_000_000)])
def test_token_bin_round_trip(tmp_path, dtype, high):
    tokens = np.random.default_rng(0).integers(0, high + 1, size=1000)
    path = tmp_path / "sub" / "train.bin"
    assert write_token_bin(path, tokens, dtype=dtype) == 1000
    assert path.stat().st_size == 1000 * np.dtype(dtype).itemsize
    tb = load_token_bin(path, dtype=dtype)
    assert len(tb) == 1000
    assert isinstance(tb.array, np.memmap) and tb.array.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(tb), tokens)
    np.testing.assert_array_equal(tb[10:20], tokens[10:20])
    # nanoGPT compatibility: a raw memmap reads the same ids
    np.testing.assert_array_equal(np.memmap(path, dtype=dtype, mode="r"), tokens)


def test_token_bin_streamed_chunks_and_pickle_by_path(tmp_path):
    path = tmp_path / "t.bin"
    write_token_bin(path, (np.arange(i * 10, i * 10 + 10) for i in range(5)))
    tb = TokenBin(path)
    np.testing.assert_array_equal(np.asarray(tb), np.arange(50))
    blob = pickle.dumps(tb)
    assert len(blob) < 500  # the path travels, not the tokens
    np.testing.assert_array_equal(np.asarray(pickle.loads(blob)), np.arange(50))


def test_token_bin_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.bin' does not exist; expected a raw uint16"):
        load_token_bin(tmp_path / "nope.bin")
    with pytest.raises(ValueError, match=r"must be in \[0, 65535\].*dtype='uint32'"):
        write_token_bin(tmp_path / "big.bin", np.array([70_000]))
    assert not (tmp_path / "big.bin").exists() and not (tmp_path / "big.bin.tmp").exists()
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a multiple of 2"):
        load_token_bin(tmp_path / "odd.bin")
    with pytest.raises(ValueError, match=r"dtype must be one of \['uint16', 'uint32'\]"):
        load_token_bin(tmp_path / "odd.bin", dtype="int8")
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32


def test_pipeline_reads_a_bin_file(tmp_path):
    write_token_bin(tmp_path / "t.bin", np.arange(1001) % 500)
    it = make_pipeline(load_source(tmp_path / "t.bin"), seq_len=10, batch_size=4, shuffle=False)
    b = next(it)
    np.testing.assert_array_equal(b["inputs"][1], np.arange(10, 20))
    np.testing.assert_array_equal(b["targets"][1], np.arange(11, 21))
