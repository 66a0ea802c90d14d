"""Each mistake a user makes on the command line is one `error: ...` line naming the fix, exit 2, and
the run directory it pointed at is left exactly as it was."""

import json
import pathlib
import re

import numpy as np
import pytest

from ember.launch import train
from ember.launch.cli import run_main

TINY = ["--backend", "eager", "--model.n_layers", "1", "--data.seq_len", "32", "--data.batch_size", "4",
        "--sample_tokens", "0", "--data.max_bytes", "100000"]


def _snapshot(d: pathlib.Path):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A finished run with checkpoints, and the odd files users point --data.path at."""
    root = tmp_path_factory.mktemp("mistakes")
    out = root / "run"
    assert run_main(lambda: train.main(["--steps", "2", "--checkpoint_every", "0", "--out", str(out), *TINY])) == 0
    (root / "empty.txt").write_text("")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 40)
    np.arange(5000, dtype=np.uint16).tofile(root / "tokens.bin")
    (root / "short.txt").write_text("hi there")
    return root


MISTAKES = {
    "nan-lr": (["--optim.learning_rate", "nan"], "optim.learning_rate=nan: expected a finite number > 0"),
    "negative-lr": (["--optim.learning_rate", "-1e-3"], "optim.learning_rate=-0.001: expected a finite number > 0"),
    "negative-steps": (["--steps", "-3"], "steps=-3: expected an int >= 1. Pass --steps"),
    "log-every-0": (["--log_every", "0"], "log_every=0: expected an int >= 1"),
    "flag-typo": (["--optim.lrr", "1"], "unknown flag --optim.lrr; did you mean"),
    "keep-best-schedule": (["--keep_best", "eval_loss", "--checkpoint_every", "30"], "pass --checkpoint_every 100"),
    "bin-as-text": (["--data.source", "text", "--data.path", "{root}/tokens.bin"], "pass --data.source bin"),
    "text-as-bin": (["--data.source", "bin", "--data.path", "{root}/short.txt"], "pass --data.source text"),
    "binary-text": (["--data.source", "text", "--data.path", "{root}/binary.txt"], "binary.txt is not text"),
    "empty-corpus": (["--data.source", "text", "--data.path", "{root}/empty.txt"], r"empty.txt is empty \(0 bytes\)"),
    "too-short": (["--data.source", "text", "--data.path", "{root}/short.txt"], "needs at least 33 tokens"),
    "no-such-step": (["--resume_step", "7"], "--resume_step 7: no checkpoint for step 7 in .*saved steps: 2"),
    "mesh-without-torchrun": (["--mesh", "dp=2"], "start it as `python launch/train.py --nproc-per-node N --mesh dp=2"),
    "pp-blocks-unstacked": (["--nproc-per-node", "2", "--mesh", "pp=2", "--model.scan_layers", "false"],
                            "this model's blocks are a list, not one stack: pass --model.scan_layers true"),
    "pp-layers-uneven": (["--nproc-per-node", "2", "--mesh", "pp=2"],
                         r"--mesh pp=2 splits the layers into pp=2 stages, but the model's 1 stacked layer does not "
                         r"split into 2 equal stages: pass --model.n_layers 2 \(a multiple of 2\)\. "),
    "cp-sequence-uneven": (["--nproc-per-node", "2", "--mesh", "cp=2", "--data.seq_len", "30"],
                           r"a sequence of 30 tokens does not split into 2 x cp = 4 .* multiple of 4 \(--data.seq_len\)"),
    "muon-flag-with-adamw": (["--optim.muon_momentum", "0.9"], r"optim.muon_momentum is read by Muon only, but "
                             r"optim.name='adamw'; drop --optim.muon_momentum or choose --optim.name muon"),
    "muon-with-lora": (["--optim.name", "muon", "--lora.rank", "2"], "train LoRA with --optim.name adamw"),
    "cuda-graph-eager": (["--cuda_graph", "True"], "--cuda_graph True captures the Inductor-compiled step, but "
                                                   "--backend eager compiles none; pass --backend inductor"),
}


@pytest.mark.parametrize("argv, message", list(MISTAKES.values()), ids=list(MISTAKES))
def test_a_mistake_is_one_line_exit_2_and_the_run_directory_is_untouched(argv, message, earlier_run, capsys,
                                                                        monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the --nproc-per-node cases are refused before ranks start
    out = earlier_run / "run"
    before = _snapshot(out)
    argv = [a.format(root=earlier_run) for a in argv]
    common = ["--resume", "--steps", "4", "--checkpoint_every", "0", "--out", str(out), *TINY]
    assert run_main(lambda: train.main([*common, *argv])) == 2  # the case's flags come last: they win
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert _snapshot(out) == before


def test_rerun_without_resume_is_refused_and_changes_nothing(earlier_run, capsys):
    out = earlier_run / "run"
    before = _snapshot(out)
    assert run_main(lambda: train.main(["--steps", "2", "--out", str(out), *TINY])) == 2
    assert "already holds a run" in capsys.readouterr().err and _snapshot(out) == before


def test_an_unknown_keep_best_metric_is_refused_before_any_file_is_written(tmp_path, capsys):
    out = tmp_path / "fresh"
    argv = ["--steps", "2", "--checkpoint_every", "0", "--keep_best", "val_loss", "--out", str(out), *TINY]
    assert run_main(lambda: train.main(argv)) == 2
    err = capsys.readouterr().err
    assert "keep_best='val_loss' names no metric this run evaluates" in err and "--keep_best eval_loss" in err
    assert _snapshot(out) == {}


def _flip_the_largest_array_file(step_dir: pathlib.Path) -> None:
    arrays = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    path = max(arrays, key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_latest_step_names_resume_step_which_restores_an_earlier_one(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--steps", "4", "--checkpoint_every", "2", "--log_every", "1", "--out", str(out), *TINY]
    assert run_main(lambda: train.main(argv)) == 0
    _flip_the_largest_array_file(out / "checkpoints" / "4")
    later = _snapshot(out / "checkpoints" / "4")
    capsys.readouterr()
    assert run_main(lambda: train.main([*argv, "--resume"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 4 in" in err[0] and "is corrupted" in err[0] and "pass --resume_step 2" in err[0]
    assert _snapshot(out / "checkpoints" / "4") == later
    assert run_main(lambda: train.main([*argv, "--resume_step", "2"])) == 0
    said = capsys.readouterr().out
    assert "moved the later checkpoints [4] to" in said and "resumed from step 2" in said
    assert _snapshot(out / "checkpoints-after-2" / "4") == later  # kept, not deleted
    assert (out / "checkpoints" / "4").is_dir()  # saved again by the resumed run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]


def test_help_lists_the_launcher_flags_and_every_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--config NAME", "--import PKG", "--mesh AXES", "--resume ", "--resume_step N", "--dry-run",
                 "--overwrite", "--list-configs", "--optim.learning-rate"):
        assert flag in text, flag
    assert "llama3_tiny" in text and "the default run" in text and "gpt2_tiny" in text


def test_list_configs_prints_each_with_its_description(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--list-configs"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "run configs (--config NAME):"
    assert any(line.split()[0] == "llama3_125m" and "benchmarks" in line for line in lines[1:])
