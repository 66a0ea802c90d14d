"""Sources: the embedded stdlib corpus, hash splits, text files and `load_source`."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from ember.data import TextFiles, load_source, split_of, stdlib_corpus, stdlib_root, text_files

SMALL = 200_000  # bytes of stdlib source: enough files for a split, fast to read


def test_stdlib_root_is_the_running_interpreter():
    assert stdlib_root() == Path(sysconfig.get_paths()["stdlib"])


def test_stdlib_corpus_only_py_files_of_this_interpreter():
    docs = stdlib_corpus(split="all", max_bytes=SMALL)
    root = stdlib_root().resolve()
    assert len(docs) > 5
    for path, name in zip(docs.paths, docs.names):
        assert path.suffix == ".py"
        assert path.resolve().is_relative_to(root)
        assert "site-packages" not in Path(name).parts
        assert not {"test", "tests", "idle_test"} & set(Path(name).parts)
    assert docs.names == sorted(docs.names)
    assert 0 < docs.total_bytes() <= SMALL
    assert docs[0] == docs.paths[0].read_text(encoding="utf-8", errors="replace")


def test_stdlib_corpus_is_deterministic():
    a = stdlib_corpus(max_bytes=SMALL)
    b = stdlib_corpus(max_bytes=SMALL)
    assert a.names == b.names
    assert list(a) == list(b)


def test_stdlib_corpus_include_tests_adds_test_files():
    names = stdlib_corpus(split="all", include_tests=True).names
    assert any(n.startswith("test/") for n in names)
    assert not any("site-packages" in n for n in names)


def test_train_eval_split_is_disjoint_and_complete():
    every = set(stdlib_corpus(split="all").names)
    train = set(stdlib_corpus(split="train", eval_fraction=0.2).names)
    evals = set(stdlib_corpus(split="eval", eval_fraction=0.2).names)
    assert train and evals
    assert not train & evals
    assert train | evals == every
    assert 0.1 < len(evals) / len(every) < 0.3
    assert all(split_of(n, eval_fraction=0.2) == "eval" for n in evals)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(split="test"), r"split must be one of \['train', 'eval', 'all'\]"),
        (dict(eval_fraction=1.5), r"eval_fraction must be in \[0, 1\]"),
        (dict(max_bytes=0), r"max_bytes must be a positive"),
    ],
    ids=["split", "eval_fraction", "max_bytes"],
)
def test_stdlib_corpus_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        stdlib_corpus(**kwargs)


def test_text_files_dir_glob_and_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee", encoding="utf-8")
    (tmp_path / "sub" / "a.txt").write_text("ä", encoding="utf-8")
    (tmp_path / "c.md").write_text("not text", encoding="utf-8")
    docs = text_files(tmp_path)
    assert docs.names == ["b.txt", "sub/a.txt"]
    assert list(docs) == ["bee", "ä"]
    assert list(text_files(str(tmp_path / "*.md"))) == ["not text"]
    assert list(text_files(tmp_path / "b.txt")) == ["bee"]
    assert isinstance(docs[:1], TextFiles) and list(docs[:1]) == ["bee"]


def test_text_files_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"nope.*does not exist.*text file"):
        text_files(missing)
    with pytest.raises(FileNotFoundError, match=r"no files matching pattern='\*\*/\*.txt'"):
        text_files(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"glob .* matches no files"):
        text_files(str(tmp_path / "*.xyz"))


def test_load_source_dispatch(tmp_path):
    assert load_source("stdlib", max_bytes=10_000).names == stdlib_corpus(max_bytes=10_000).names
    (tmp_path / "a.txt").write_text("x", encoding="utf-8")
    assert list(load_source(tmp_path)) == ["x"]
    with pytest.raises(FileNotFoundError, match=r"data source '.*missing' does not exist; expected 'stdlib'"):
        load_source(str(tmp_path / "missing"))
