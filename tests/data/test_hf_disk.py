"""Hugging Face datasets saved with save_to_disk, read as a text corpus (no download)."""

from __future__ import annotations

import numpy as np
import pytest

from ember.data import ByteTokenizer, hf_text_from_disk, load_source, make_pipeline

datasets = pytest.importorskip("datasets", reason="Hugging Face `datasets` is in the test extras")


def test_hf_dataset_from_disk(tmp_path):
    rows = {"text": ["first doc", "second — doc", "third"], "label": [0, 1, 2]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    docs = hf_text_from_disk(tmp_path / "ds")
    assert len(docs) == 3 and docs[1] == "second — doc"
    assert list(docs) == rows["text"]
    assert list(load_source(tmp_path / "ds")) == rows["text"]
    it = make_pipeline(docs, tokenizer=ByteTokenizer(eos=True), seq_len=4, batch_size=2, shuffle=False)
    np.testing.assert_array_equal(next(it)["inputs"][0], list(b"firs"))


def test_hf_dataset_dict_and_errors(tmp_path):
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"content": ["a", "b"]}),
        validation=datasets.Dataset.from_dict({"content": ["c"]}),
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert list(hf_text_from_disk(tmp_path / "dd", split="validation", field="content")) == ["c"]
    assert list(load_source(tmp_path / "dd", field="content")) == ["a", "b"]
    with pytest.raises(ValueError, match=r"splits \['train', 'validation'\]; pass split"):
        hf_text_from_disk(tmp_path / "dd", field="content")
    with pytest.raises(ValueError, match=r"split='test' is not in"):
        hf_text_from_disk(tmp_path / "dd", split="test", field="content")
    with pytest.raises(ValueError, match=r"field='contnt' is not a column.*Did you mean 'content'"):
        hf_text_from_disk(tmp_path / "dd", split="train", field="contnt")
    with pytest.raises(FileNotFoundError, match=r"missing.*does not exist.*save_to_disk"):
        hf_text_from_disk(tmp_path / "missing")
