"""What a new user meets first: each mistake is one `error: ...` line naming the fix (exit 2), checked before
the run directory is touched, and a finished run resumed is a notice (exit 0) that changes nothing."""

import errno
import os
import pathlib
import sys

import pytest

from ember.launch import train
from ember.launch.cli import run_main
from ember.launch.run_config import parse_cli
from ember.launch.run_dir import LOCK_FILE, RunDirectoryError, claim_run_directory

TINY = ["--backend", "eager", "--model.n_layers", "1", "--data.seq_len", "32", "--data.batch_size", "4",
        "--sample_tokens", "0", "--data.max_bytes", "100000"]


def _snapshot(d: pathlib.Path):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and err[0].endswith("(EMBER_DEBUG=1 shows the traceback)"), err
    return err[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step llama3 run (1 layer) with its last checkpoint."""
    out = tmp_path_factory.mktemp("new_user") / "run"
    assert run_main(lambda: train.main(["--steps", "2", "--checkpoint_every", "0", "--out", str(out), *TINY])) == 0
    return out


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("EMBER_DEBUG", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def test_backend_xla_without_torch_xla_is_one_line_before_the_run_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # `import torch_xla` fails, as where it is not installed
    out = tmp_path / "xla"
    assert run_main(lambda: train.main(["--backend", "xla", "--steps", "2", "--out", str(out), *TINY[2:]])) == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: --backend xla needs torch_xla, which is not importable here (")
    assert "make install-xla" in line and '"ember[xla]"' in line and "or pass --backend inductor." in line
    assert not out.exists()


def test_a_run_that_fails_before_writing_removes_only_the_folders_it_created(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "run"
    argv = ["--steps", "2", "--checkpoint_every", "0", "--keep_best", "val_loss", *TINY]  # refused after a first eval
    assert run_main(lambda: train.main([*argv, "--out", str(out)])) == 2
    assert "keep_best='val_loss' names no metric" in _one_error_line(capsys)
    assert sorted(tmp_path.iterdir()) == []  # new/deeper/run: all three were made by the run, all three gone
    kept = tmp_path / "kept"
    kept.mkdir()
    assert run_main(lambda: train.main([*argv, "--out", str(kept)])) == 2
    assert kept.is_dir() and list(kept.iterdir()) == []  # it existed before: never removed
    with pytest.raises(ZeroDivisionError):
        with claim_run_directory(str(tmp_path / "notes"), resume=False):
            (tmp_path / "notes" / "notes.txt").write_text("mine")  # it holds something: kept
            1 / 0
    assert _snapshot(tmp_path / "notes") == {pathlib.Path("notes.txt"): b"mine"}


def test_an_out_that_is_a_file_is_one_line_and_the_file_is_kept(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for out, says in ((file, f"--out {file} is a file"), (file / "run", f"--out {file / 'run'}: {file} is a file")):
        assert run_main(lambda: train.main(["--steps", "2", "--out", str(out), *TINY])) == 2
        assert _one_error_line(capsys).startswith(f"error: {says}, not a directory; pass --out a directory path (e.g. "
                                                  f"runs/NAME). ")
    assert file.read_text() == "mine" and sorted(tmp_path.iterdir()) == [file]


def test_a_read_only_out_is_one_line_and_nothing_changes(tmp_path, capsys, monkeypatch):
    real_open, real_link, real_makedirs = os.open, os.link, os.makedirs

    def read_only(path, *args, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    out = tmp_path / "ro"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    monkeypatch.setattr(os, "open", lambda path, *a, **kw: (read_only if str(path).endswith(LOCK_FILE) else real_open)(
        path, *a, **kw))
    monkeypatch.setattr(os, "link", lambda src, dst, *a, **kw: (read_only if str(dst).endswith(LOCK_FILE) else real_link)(
        src, dst, *a, **kw))
    assert run_main(lambda: train.main(["--steps", "2", "--out", str(out), *TINY])) == 2
    assert _one_error_line(capsys).startswith(f"error: --out {out} cannot be written (Read-only file system); pass "
                                              f"--out a directory you can write to (e.g. runs/NAME), or make it writable.")
    assert _snapshot(out) == before
    monkeypatch.setattr(os, "makedirs", lambda path, *a, **kw: (read_only if "ro2" in str(path) else real_makedirs)(
        path, *a, **kw))
    with pytest.raises(RunDirectoryError, match=r"--out .*ro2/run cannot be written \(Read-only file system\)"):
        with claim_run_directory(str(tmp_path / "ro2" / "run"), resume=False):
            pytest.fail("entered a directory that cannot be made")


def test_init_from_another_shape_or_family_names_the_fields_and_the_flags(finished_run, tmp_path, capsys):
    before = _snapshot(finished_run)
    out = tmp_path / "b"
    common = ["--steps", "2", "--init_from", str(finished_run), "--out", str(out), *TINY]
    assert run_main(lambda: train.main([*common, "--model.n_layers", "2"])) == 2
    line = _one_error_line(capsys)
    assert line == (f"error: --init_from {finished_run}: the checkpoint holds another llama3 model than the run config: "
                    f"n_layers 1 there, 2 configured. To start from it, set --model.n_layers 1. "
                    f"(EMBER_DEBUG=1 shows the traceback)")
    assert run_main(lambda: train.main(["--config", "gpt2_tiny", *common])) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: --init_from {finished_run}: the checkpoint holds a llama3 model and the run config "
                           f"a gpt2 one (d_model 192 there, 64 configured; ")
    assert "n_heads 6 there, 4 configured" in line and "To start from it, use --config llama3_tiny --model.n_layers 1." in line
    assert len(line) < 400 and "CheckpointMeta" not in line
    assert not out.exists() and _snapshot(finished_run) == before
    assert run_main(lambda: train.main([*common, "--config", "llama3_tiny", "--model.n_layers", "1", "--dry-run"])) == 0


@pytest.mark.parametrize("spelling, value", [(["--model.tie_embeddings", "False"], False), (["--model.tie_embeddings=false"], False),
                                             (["--model.tie-embeddings", "0"], False), (["--model.no-tie-embeddings"], False),
                                             (["--model.tie_embeddings", "True"], True), (["--model.tie_embeddings", "1"], True),
                                             (["--model.tie_embeddings"], True)])
def test_a_boolean_takes_the_spellings_users_type(spelling, value):
    cfg = parse_cli("llama3_tiny", ["--model.no-tie-embeddings", *spelling, "--steps", "3"])
    assert cfg.model.tie_embeddings is value and cfg.steps == 3


PARSE_ERRORS = {
    "not-an-int": (["--steps", "abc"], "error: --steps abc is not a valid INT (invalid literal for int() with base 10: "
                                       "'abc'); pass e.g. --steps 300. "),
    "not-a-float": (["--optim.learning_rate", "x"], "error: --optim.learning_rate x is not a valid FLOAT (could not "
                                                    "convert string to float: 'x'); pass e.g. --optim.learning_rate 0.003. "),
    "choice": (["--backend", "xlaa"], "error: --backend xlaa is not one of eager, inductor, xla; pass e.g. --backend xla. "),
    "no-value": (["--steps"], "error: --steps needs a value; pass e.g. --steps 300. "),
    "extra-value": (["--sample_prompt", "def", "main"], "error: unexpected argument 'main' after --sample_prompt def: each "
                                                        "flag takes one value (quote a value with spaces"),
    "not-a-bool": (["--model.tie_embeddings", "maybe"], "error: --model.tie_embeddings maybe: --model.tie_embeddings is "
                                                        "true or false; pass --model.tie_embeddings True"),
}


@pytest.mark.parametrize("argv, start", list(PARSE_ERRORS.values()), ids=list(PARSE_ERRORS))
def test_a_parse_error_is_one_line_not_a_box_and_the_run_directory_is_untouched(argv, start, finished_run, capsys):
    before = _snapshot(finished_run)
    assert run_main(lambda: train.main(["--resume", "--out", str(finished_run), *TINY, *argv])) == 2
    assert _one_error_line(capsys).startswith(start)
    assert _snapshot(finished_run) == before


def test_resume_of_a_finished_run_says_so_and_changes_nothing(finished_run, capsys):
    before = _snapshot(finished_run)
    for steps in ("2", "1"):
        argv = ["--resume", "--steps", steps, "--checkpoint_every", "0", "--out", str(finished_run), *TINY]
        assert run_main(lambda: train.main(argv)) == 0
        said = capsys.readouterr()
        assert said.err == "" and said.out.splitlines() == [
            f"{finished_run} already reached step 2 of --steps {steps}: nothing to train, nothing changed. Pass a "
            f"larger --steps (e.g. --steps {2 + int(steps)}) to train on, or --overwrite without --resume to start again."]
        assert _snapshot(finished_run) == before


BOXES = {  # tyro 1.0's two drawings of one error: UTF-8 (a UTF-8 stdout) and plain, here with a colour code
    "utf8": "╭─ Value error ──────────────╮\n│ Error parsing --steps:     │\n│ invalid literal for int()  │\n"
            "│ ────────────────────────── │\n│ Argument helptext:         │\n│     --steps INT            │\n"
            "│ ────────────────────────── │\n│ For full helptext, see x   │\n╰────────────────────────────╯\n",
    "plain": " \x1b[1;31mValue error\x1b[0m\n --------------------------- \n  Error parsing --steps:\n  invalid literal for int()\n"
             "  ---------------------------\n  Argument helptext:\n      --steps INT\n  ---------------------------\n"
             "  For full helptext, see x\n \n",
}


@pytest.mark.parametrize("box", list(BOXES.values()), ids=list(BOXES))
def test_both_of_tyros_boxes_read_as_one_line(box):
    from ember.launch.flag_spelling import one_line

    assert one_line(box, ["--steps", "x"], {"steps": 300}.get) == (
        "--steps x is not a valid INT (invalid literal for int()); pass e.g. --steps 300.")
