"""Launchers answer a user's mistake with one `error: ...` line and exit 2; bugs keep their traceback."""

import os
import pathlib
import subprocess
import sys

import pytest

from ember.launch.cli import run_main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _raise(error):
    def main():
        raise error

    return main


def test_a_user_error_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("EMBER_DEBUG", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert run_main(_raise(KeyError("unknown config 'x'; did you mean 'y'?"))) == 2
    assert capsys.readouterr().err == "error: unknown config 'x'; did you mean 'y'? (EMBER_DEBUG=1 shows the traceback)\n"
    assert run_main(_raise(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C)\n"
    assert run_main(lambda: 1) == 1 and run_main(lambda: [1.0]) == 0  # an int result is the exit code


def test_only_rank_0_reports_and_debug_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert run_main(_raise(ValueError("bad"))) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("EMBER_DEBUG", "1")
    with pytest.raises(ValueError, match="bad"):
        run_main(_raise(ValueError("bad")))


def test_a_bug_is_not_dressed_as_a_user_error(monkeypatch):
    monkeypatch.delenv("EMBER_DEBUG", raising=False)
    with pytest.raises(ZeroDivisionError):
        run_main(_raise(ZeroDivisionError("division by zero")))


def test_train_py_as_a_user_runs_it():
    env = {k: v for k, v in os.environ.items() if k not in ("EMBER_DEBUG", "RANK")}
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config", "llama3_tinny"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: unknown config 'llama3_tinny'; did you mean 'llama3_tiny' or 'llama3_125m' or 'mistral_tiny'? Known: "
        "['deepseek_v3_tiny', 'dpo', 'gpt2_tiny', 'llama3_125m', 'llama3_tiny', 'mistral_tiny', 'qwen2_tiny', 'qwen3_moe_tiny', 'sft', 'tiny_chat_dpo', 'tiny_chat_sft']. Register one with @ember.launch.register_config(name) in a module you "
        "--import. (EMBER_DEBUG=1 shows the traceback)"]
