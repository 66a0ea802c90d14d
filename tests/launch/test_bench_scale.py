"""launch/bench_scale.py runs its sections in fresh processes and writes its tables (no time asserted).

The section runs are marked `bench` (`make test-bench`; about 20 minutes of CPU on two cores, so
`make test` leaves them out); its argument handling is tested in every run.

The runs shrink `llama3_tiny` to 2 layers, batch 2 x 32 (`--set`: rows of one shape share graphs) and
share one Inductor cache between their children (`TORCHINDUCTOR_CACHE_DIR`): the script's own fresh
caches would make every row a cold compile.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--set", "model.n_layers=2", "--set", "data.batch_size=2", "--set", "data.seq_len=32"]


def _env(tmp_path):
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}


@pytest.mark.bench
def test_loss_memory_scan_generate_and_packed_sections_report(tmp_path):
    md = tmp_path / "scale.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "bench_scale.py"), "--loss-memory", "--vocabs", "512",
         "--tokens", "64", "--d-model", "16", "--chunk-size", "16", "--remat-memory", "none,full",
         "--scan-steady", "none", "--generate", "8", "--packed-attention", "64", "--config", "llama3_tiny", *SMALL,
         "--markdown", str(md)],
        capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path), timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = md.read_text()
    assert "| 512 | plain |" in text and "| 512 | chunked (16 tokens) |" in text, text
    assert "| none |" in text and "| full |" in text, text
    assert "scan_layers step (ms)" in text and "| True |" in text, text  # same loss unrolled and scanned
    assert "| packed: segment mask through SDPA |" in text, text
    assert "| KV cache, compiled decode step |" in text and text.count("| True |") >= 4, text  # same tokens


def test_no_section_chosen_is_an_error():
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench_scale.py")], capture_output=True, text=True)
    assert proc.returncode == 2 and "choose at least one of --torch-primitives" in proc.stderr


def test_ratios_to_a_baseline_that_measured_nothing_read_n_a():
    # A tiny smoke-test shape can stay below RSS resolution (0 bytes measured on torch 2.9 once).
    from ember.launch.bench_scale import _ratio

    assert _ratio(1, 2) == "0.50x" and _ratio(5, 0) == "n/a"


def test_set_pairs_become_run_config_overrides_and_a_bad_one_names_the_form():
    from ember.launch.bench_scale import _set_overrides

    assert _set_overrides(["model.n_layers=2", "model.scan_layers=True"]) == {"model.n_layers": "2",
                                                                            "model.scan_layers": True}
    with pytest.raises(ValueError, match="--set expects KEY=VALUE"):
        _set_overrides(["model.n_layers"])


def test_overrides_become_the_flags_the_run_config_parses():
    from ember.launch.benchmark.scale_child import flag as _flag
    from ember.launch.run_config import parse_cli

    flags = [_flag("model.scan_layers", True), _flag("model.n_layers", 3), _flag("microbatches", 2)]
    assert flags == ["--model.scan-layers", "--model.n_layers=3", "--microbatches=2"]
    config = parse_cli("llama3_tiny", flags)
    assert config.model.scan_layers and config.model.n_layers == 3 and config.microbatches == 2
    assert not parse_cli("llama3_tiny", [*flags, _flag("model.scan_layers", False)]).model.scan_layers


@pytest.mark.bench
@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                    reason="the same script on both torch lines: its other sections' test covers the torch_xla line")
def test_baseline_primitives_and_bridged_checkpointing_sections_report(tmp_path):
    md = tmp_path / "scale.md"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "bench_scale.py"), "--baseline", head, "--compile-microbatches", "1",
         "--torch-primitives", "unrolled-none,unrolled-checkpoint", "--bridged-checkpointing", "--hf-layers", "1",
         "--hf-hidden", "64", "--batch", "1", "--seq", "16", "--config", "llama3_tiny", *SMALL,
         "--markdown", str(md)],
        capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path), timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = md.read_text()
    assert f"| baseline {head} | 1 | True |" in text and "| this tree | 1 | True |" in text, text
    assert "| unrolled | none |" in text and "| unrolled | checkpoint |" in text, text
    assert "| False |" in text and "| True |" in text, text  # checkpointing off and on
    worktrees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, cwd=ROOT).stdout
    assert "ember_baseline_" not in worktrees  # the baseline worktree is removed again
