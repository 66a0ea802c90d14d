"""launch/train.py end to end on tiny settings: outputs, a user's own family via --import (the
README's code, extracted), --dry-run, and clear errors for bad input."""

import json
import pathlib
import re
import sys

import pytest

from ember.launch import train
from ember.launch.metrics_log import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Small enough for seconds on 2 cores, big enough for the loss to fall.
TINY = ["--backend", "eager", "--data.max_bytes", "300000", "--data.batch_size", "8", "--data.seq_len", "64",
        "--log_every", "5", "--eval_every", "20", "--eval_batches", "2", "--sample_tokens", "16"]


def test_default_config_trains_and_writes_outputs(tmp_out, capsys):
    history = train.main(["--steps", "40", "--out", str(tmp_out), "--model.n_layers", "1", *TINY])
    out = capsys.readouterr().out
    assert "--- sample ---" in out and "eval loss:" in out
    for name in ("metrics.jsonl", "loss.png", "config.json"):
        assert (tmp_out / name).is_file(), name
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_out.iterdir())
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    assert evals[-1] < 0.8 * evals[0], evals  # clearly learning
    rows = [json.loads(line) for line in (tmp_out / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "grad_norm", "lr", "update_norm", "skipped"} <= set(rows[1])
    assert json.loads((tmp_out / "config.json").read_text())["model"]["n_layers"] == 1


def _readme_block(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_users_own_family_from_the_readme(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(_readme_block("Your own model family"))
    monkeypatch.syspath_prepend(str(tmp_path))
    history = train.main(["--import", "my_models", "--config", "bigram_small", "--model.d_model", "32",
                          "--steps", "20", "--out", str(tmp_path / "run"), *TINY])
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    assert evals[-1] < evals[0]
    assert "bigram" in json.loads((tmp_path / "run" / "config.json").read_text())["family"]
    # `my_models` stays imported: importing it again would register "bigram" twice (an error), and
    # tests/test_readme_commands.py imports the same README file in the same session.


def test_dry_run_prints_shapes_axes_memory(capsys):
    assert train.main(["--dry-run", "--config", "gpt2_tiny"]) is None
    out = capsys.readouterr().out
    assert "blocks.attn.wq.weight" in out and "('layers', 'heads', 'embed')" in out
    assert "total:" in out and "GiB" in out


@pytest.mark.parametrize(
    "argv, error, match",
    [
        (["--config", "llama3_tinny"], KeyError, "did you mean 'llama3_tiny'"),
        (["--data.source", "text", "--data.path", "/nonexistent/corpus.txt"], FileNotFoundError, "/nonexistent/corpus.txt"),
        (["--data.seq_len", "4096"], ValueError, r"data.seq_len=4096 is above .* model.max_seq_len=256"),
        (["--model.vocab_size", "64"], ValueError, r"tokenizer has 257 ids but model.vocab_size=64"),
    ],
    ids=["unknown-config", "missing-corpus", "seq-too-long", "vocab-too-small"],
)
def test_bad_input_has_clear_errors(argv, error, match, tmp_out):
    with pytest.raises(error, match=match):
        train.main([*argv, "--steps", "1", "--out", str(tmp_out), *TINY[:2]])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.n_layer", "2"], "did you mean --model.n_layers"),  # a typo: the closest flags
        (["--model.n_heads", "5"], "Choose n_heads among the divisors of d_model"),  # config validation
    ],
    ids=["field-typo", "heads-dont-divide"],
)
def test_command_line_errors_exit_with_the_fix(argv, message):
    with pytest.raises(ValueError, match=message):  # run_main prints it as one `error:` line, exit 2
        train.main([*argv, "--dry-run"])


USER_COLLATOR = '''
from ember.data import collator, to_torch

CALLS = []

@collator("counting")
def counting(batch, *, device=None):
    CALLS.append(batch["inputs"].shape)
    return to_torch(batch, device=device)
'''


def test_users_collator_is_found_after_import(tmp_path, monkeypatch):
    (tmp_path / "my_collators.py").write_text(USER_COLLATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    train.main(["--import", "my_collators", "--data.collate", "counting", "--steps", "3", "--out", str(tmp_path / "run"),
                "--model.n_layers", "1", *TINY])
    assert len(sys.modules["my_collators"].CALLS) >= 3  # train batches (+ eval batches)
    sys.modules.pop("my_collators", None)


def test_resume_after_a_crash_repeats_the_lost_steps_bit_for_bit(tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    argv = [*TINY, "--steps", "6", "--checkpoint_every", "3", "--keep", "0", "--out", str(out), "--model.n_layers", "1",
            "--log_every", "1"]
    train.main(argv)
    straight = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    shutil.rmtree(out / "checkpoints" / "6")  # as if killed before the last checkpoint was written
    train.main([*argv, "--resume"])
    assert "resumed from step 3" in capsys.readouterr().out
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the rows after step 3 were replaced, not repeated
    resumed = {r["step"]: r["loss"] for r in rows[3:]}
    assert all(resumed[s] == straight[s] for s in resumed), (resumed, straight)  # bit for bit
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [3, 6]
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoints, config.json, .*\); pass --resume to "
                                         r"continue it, --overwrite to replace it"):
        train.main(argv)  # a fresh run into the same --out would mix two runs' files
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [3, 6]
