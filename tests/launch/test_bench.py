"""launch/bench.py: every variant runs and reports, the JAX model is the same model (GPT-2 and Llama,
stacked blocks too), memory and ember_xla children report, BENCHMARKS.md sections are replaced.
No test asserts a time: the machine is shared."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from ember.core.pytree import tree_leaves
from ember.launch import benchmark
from ember.launch.run_config import parse_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]

SMALL = ["--model.n_layers", "1", "--data.batch_size", "4", "--data.seq_len", "32"]


def _bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench.py"), "--quick", "--json", str(out), *args],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_quick_run_reports_every_default_variant(tmp_path):
    res, stdout = _bench(tmp_path, "--config", "llama3_tiny", "--markdown", str(tmp_path / "B.md"), *SMALL)
    assert set(res["variants"]) == set(benchmark.default_variants(torch.device("cpu")))
    for name, r in res["variants"].items():
        assert len(r["times_ms"]) == 3 and min(r["times_ms"]) > 0, name
        assert r["first_call_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"], name
        # every variant starts from the same weights and batch, so the same loss
        assert r["first_loss"] == pytest.approx(res["initial_loss"]["ember"], abs=1e-4), name
    assert res["variants"]["torch_compiled"]["ratio_vs_baseline"] == 1.0
    assert res["initial_loss"]["abs_diff"] <= 1e-4
    assert "initial loss: ember" in stdout and "| ember_inductor_donated |" in stdout
    assert (tmp_path / "B.md").read_text().count("## llama3_tiny") == 1
    assert res["machine"]["malloc"] == "keeps freed memory"  # as launch/train.py runs (glibc)
    assert "; malloc: keeps freed memory." in (tmp_path / "B.md").read_text()


@pytest.mark.slow
def test_scan_variant_trains_the_same_weights_stacked(tmp_path):
    res, stdout = _bench(tmp_path, "--variants", "ember_eager,ember_inductor_scan", "--model.n_layers", "2",
                         "--data.batch_size", "4", "--data.seq_len", "32")
    first = {name: r["first_loss"] for name, r in res["variants"].items()}
    assert first["ember_inductor_scan"] == pytest.approx(first["ember_eager"], abs=1e-4)
    assert "scan_layers=True" in stdout


@pytest.mark.slow
@pytest.mark.xla
def test_memory_and_xla_children(tmp_path):
    pytest.importorskip("torch_xla")
    res, stdout = _bench(tmp_path, "--variants", "ember_eager,torch_eager,ember_xla", "--memory", *SMALL)
    n_bytes = 4 * res["n_params"]
    for name in ("ember_eager", "torch_eager"):
        mem = res["memory"][name]
        assert mem["transient_bytes"] > 0 and mem["kind"] == "cpu_rss", mem
        assert 3 * n_bytes <= mem["state_bytes"] < 3 * n_bytes + 4096, mem  # params + two Adam moments
    x = res["ember_xla"]
    assert x["compiles_first_call"] >= 1 and x["compiles_after_first_call"] == 0, x
    assert x["lr_last"] != x["lr_first"] and x["median_ms"] > 0  # the lr schedule moved, no recompile
    assert "more over 5 steps" in stdout


@pytest.mark.slow
def test_compile_times_run_cold_then_warm_in_fresh_processes(tmp_path):
    res, stdout = _bench(tmp_path, "--variants", "ember_eager,torch_eager", "--compile-times", "ember_eager",
                         "--markdown", str(tmp_path / "B.md"), *SMALL)
    assert set(res["compile_times"]) == {"ember_eager"}
    t = res["compile_times"]["ember_eager"]
    assert t["cold_s"] > 0 and t["warm_s"] > 0, t
    assert "ember_eager: first call" in stdout
    assert "`ember_eager` " in (tmp_path / "B.md").read_text()


JAX_CASES = [  # (config, overrides): the JAX forward must give ember's loss on the same weights
    ("llama3_tiny", ["--model.n_layers", "2"]),
    ("llama3_tiny", ["--model.n_layers", "2", "--model.scan-layers", "--model.no-tie-embeddings"]),
    ("gpt2_tiny", ["--model.n_layers", "2"]),
    ("gpt2_tiny", ["--model.n_layers", "1", "--model.activation", "gelu", "--model.no-bias"]),
]


@pytest.mark.parametrize("config,overrides", JAX_CASES, ids=["llama", "llama-scan-untied", "gpt2", "gpt2-erf-nobias"])
def test_jax_model_matches_ember(config, overrides):
    jax = pytest.importorskip("jax")
    from ember.models import lm_loss

    cfg = parse_cli(config, [*overrides, "--data.batch_size", "2", "--data.seq_len", "16"])
    s = benchmark.build_setup(cfg, device=torch.device("cpu"))
    with torch.no_grad():
        ours = float(lm_loss(s.model)(s.params, s.batch, key=None).mean())
    theirs = float(jax.jit(benchmark.jax_loss_fn(s))(benchmark.jax_params(s), s.batch["inputs"].numpy(),
                                                     s.batch["targets"].numpy()))
    assert theirs == pytest.approx(ours, abs=1e-5)


def test_fast_init_and_flops():
    cfg = parse_cli("llama3_tiny", ["--data.seq_len", "64"])
    s = benchmark.build_setup(cfg, device=torch.device("cpu"), init="fast")
    c = cfg.model
    n = sum(t.numel() for t in tree_leaves(s.params))
    assert s.init == "fast" and float(s.params["ln_f"]["weight"].min()) == 1.0
    assert 0.015 < float(s.params["wte"]["weight"].std()) < 0.025  # N(0, init_std)
    fl = benchmark.flops_per_token(s)  # tied embedding: every param is in a matmul
    assert fl == {"n_matmul_params": n, "flops_per_token": 6 * n + 12 * c.n_layers * c.d_model * 64}


def test_markdown_section_is_replaced_not_duplicated(tmp_path):
    path = str(tmp_path / "BENCHMARKS.md")
    benchmark.update_markdown(path, "## a\n\nold a\n")
    benchmark.update_markdown(path, "## b\n\nonly b\n")
    benchmark.update_markdown(path, "## a\n\nnew a\n")
    text = pathlib.Path(path).read_text()
    assert text.startswith("# ember benchmarks") and text.count("## a") == 1 and text.count("## b") == 1
    assert "new a" in text and "old a" not in text and "only b" in text


def test_unknown_variant_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown variant 'torch_jit'.*ember_inductor_donated"):
        benchmark.build_variant("torch_jit", None)
