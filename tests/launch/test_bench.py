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
from ember.launch.benchmark.torch_baseline import torch_variant
from ember.launch.benchmark.variants import ember_variant
from ember.launch.run_config import parse_cli

pytestmark = pytest.mark.xdist_group("bench")  # one worker runs the module: its shared fixture runs once

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


@pytest.mark.bench  # a section of the script end to end: `make test-bench`
def test_list_variant_trains_the_same_weights_unstacked(tmp_path):
    res, stdout = _bench(tmp_path, "--variants", "ember_eager,ember_inductor_list", "--model.n_layers", "2",
                         "--data.batch_size", "4", "--data.seq_len", "32")
    first = {name: r["first_loss"] for name, r in res["variants"].items()}
    assert first["ember_inductor_list"] == pytest.approx(first["ember_eager"], abs=1e-4)
    assert "scan_layers=False" in stdout


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


@pytest.mark.bench  # a section of the script end to end: `make test-bench`
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


@pytest.fixture(scope="module")
def tiny_setup():
    return benchmark.build_setup(parse_cli("llama3_tiny", SMALL), device=torch.device("cpu"))


def test_each_row_is_scored_against_the_peak_of_its_own_dtype(tiny_setup):
    s = tiny_setup
    # eager builds of the bf16 variants (the compiled ones differ only in torch.compile / backend)
    built = {"ember_eager": benchmark.build_variant("ember_eager", s),
             "ember_bf16": ember_variant(s, backend="eager", compute_dtype=torch.bfloat16),
             "torch_bf16": torch_variant(s, compile=False, autocast=torch.bfloat16),
             "torch_eager": benchmark.build_variant("torch_eager", s)}
    dtypes = {n: v.dtype for n, v in built.items()}
    assert dtypes == {"ember_eager": "float32", "ember_bf16": "bfloat16", "torch_bf16": "bfloat16",
                      "torch_eager": "float32"}
    names = list(dtypes)
    peak = benchmark.matmul_peak(s.device, dtype=torch.bfloat16, n=64, reps=1)
    assert peak["dtype"] == "bfloat16" and peak["matmul"] == "64x64x64 bfloat16" and peak["flops"] > 0
    peaks = {"float32": {"flops": 1e11, "matmul": "2048x2048x2048 float32", "dtype": "float32"},
             "bfloat16": {"flops": 4e11, "matmul": "1024x1024x1024 bfloat16", "dtype": "bfloat16"}}
    timed = {n: {"times": [0.1, 0.1], "first_call_s": 1.0, "first_loss": 5.0, "last_loss": 4.0} for n in names}
    res = benchmark.results(s, timed, peaks=peaks, dtypes=dtypes, warmup=1, iters=2, config="llama3_tiny",
                            initial_loss={"ember": 5.0}, command="python launch/bench.py", notes={})
    rows = res["variants"]
    assert rows["torch_bf16"]["peak_dtype"] == "bfloat16" and rows["torch_eager"]["peak_dtype"] == "float32"
    assert rows["ember_eager"]["mfu"] == pytest.approx(4 * rows["ember_bf16"]["mfu"])
    assert rows["ember_bf16"]["peak_flops"] == 4e11 and res["peaks"] == peaks
    section = benchmark.markdown_section(res)
    assert "(bfloat16) |" in section and "1024x1024x1024 bfloat16 matmul" in section


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_graph_variants_are_refused_on_the_cpu(tiny_setup):
    for name in ("ember_inductor_cudagraph", "ember_inductor_bf16_cudagraph"):
        with pytest.raises(ValueError, match=r"cuda_graph=True.*no CUDA GPU"):
            benchmark.build_variant(name, tiny_setup)
