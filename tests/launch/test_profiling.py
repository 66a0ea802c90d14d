"""ember.launch.profiling: `--profile.steps A:B` traces run steps A..B without changing the compiled step."""

import json

import pytest
import torch

from ember import data
from ember.core import jit
from ember.core.pytree import tree_leaves
from ember.data.config import DataConfig
from ember.launch import build, train
from ember.launch.cli import run_main
from ember.launch.loop import train_loop
from ember.launch.metrics_log import MetricsWriter
from ember.launch.profiling import ProfileConfig, StepProfiler
from ember.launch.run_config import TrainConfig
from ember.models import get_config


def _cfg(**kw):
    model = get_config("llama3", "tiny").replace(vocab_size=320, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                                 ffn_dim=64, max_seq_len=16)
    return TrainConfig(family="llama3", model=model, data=DataConfig(max_bytes=30_000, seq_len=16, batch_size=4),
                       steps=6, log_every=1, **kw)


def _run(cfg, step, model, tokenizer, profiler):
    state = build.initial_state(cfg, model)
    writer = MetricsWriter(None)
    state = train_loop(step, state, data.build_batches(cfg.data, tokenizer=tokenizer), steps=cfg.steps,
                       writer=writer, log_every=1, progress=False, profiler=profiler)
    return state, [r["loss"] for r in writer.history]


def test_a_traced_compiled_run_is_the_run_without_the_trace(tmp_path, capsys):
    cfg = _cfg(profile=ProfileConfig(steps="3:5"))
    model = build.build_model(cfg)
    tokenizer = build.build_tokenizer(cfg, model)
    step = jit(build.step_fn(cfg, model), backend="inductor", donate="state")
    traced, traced_losses = _run(cfg, step, model, tokenizer, StepProfiler(cfg.profile, tmp_path))
    plain, plain_losses = _run(cfg, step, model, tokenizer, None)
    assert step.compile_count == 1  # the profiler only observes: no recompile, in either run
    assert traced_losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(traced.params), tree_leaves(plain.params)))
    path = tmp_path / "profile" / "trace_steps_3-5.json"
    trace = json.loads(path.read_text())  # the Chrome trace format Perfetto and chrome://tracing load
    steps = sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]  # the run's own step numbers
    said = capsys.readouterr().out
    assert f"traced into {path}" in said and "https://ui.perfetto.dev" in said


def test_memory_on_the_cpu_writes_the_allocator_table(tmp_path):
    cfg = _cfg(profile=ProfileConfig(steps="2:2", memory=True))
    model = build.build_model(cfg)
    step = jit(build.step_fn(cfg, model), backend="eager", donate="state")
    _run(cfg, step, model, build.build_tokenizer(cfg, model), StepProfiler(cfg.profile, tmp_path, say=lambda _: None))
    table = (tmp_path / "profile" / "memory_table.txt").read_text()
    assert "CPU Mem" in table and (tmp_path / "profile" / "trace_steps_2-2.json").is_file()


BAD_RANGES = [  # (ProfileConfig kwargs, steps, resumed from, message)
    (dict(steps="5:3"), 6, 0, r"'5:3': the first step 5 is after the last 3; pass A:B with 1 <= A <= B"),
    (dict(steps="0:2"), 6, 0, r"'0:2': steps count from 1, got 0"),
    (dict(steps="3"), 6, 0, r"'3' is not A:B \(two step numbers\)"),
    (dict(steps="a:b"), 6, 0, r"'a:b' is not A:B"),
    (dict(steps="3:9"), 6, 0, r"'3:9' ends after the run's last step 6; .* --profile.steps 3:6, or raise --steps to 9"),
    (dict(steps="2:4"), 6, 3, r"'2:4' starts at step 2, but the run resumes after step 3; .* --profile.steps 4:6"),
    (dict(memory=True), 6, 0, r"--profile.memory records memory over the traced steps, but --profile.steps is not set"),
]


@pytest.mark.parametrize("kw, steps, start, match", BAD_RANGES, ids=[c[3][:12] for c in BAD_RANGES])
def test_a_range_outside_the_run_is_refused_in_one_line(kw, steps, start, match):
    with pytest.raises(ValueError, match=match) as raised:
        ProfileConfig(**kw).check(steps=steps, start=start)
    assert "\n" not in str(raised.value)


def test_the_launcher_refuses_a_range_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--steps", "4", "--profile.steps", "3:9", "--out", str(out), "--backend", "eager"]
    assert run_main(lambda: train.main(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ends after the run's last step 4" in err[0]
    assert not out.exists()


@pytest.mark.xla
def test_a_pod_run_traces_its_steps_with_the_xla_profiler(tmp_path):
    """launch/tpu_pod.py --profile.steps 2:3 on 2 virtual CPU devices: an XLA trace of steps 2 and 3, and the run
    still matches the single-device reference with one compile."""
    import gzip
    import importlib.util
    import os
    import pathlib
    import re
    import subprocess
    import sys

    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla], or make install)")
    script = pathlib.Path(__file__).resolve().parents[2] / "launch" / "tpu_pod.py"
    out = tmp_path / "pod"
    argv = ["--mesh", "dp=2", "--steps", "3", "--data.batch_size", "4", "--data.seq_len", "32", "--data.max_bytes",
            "100000", "--model.n_layers", "1", "--profile.steps", "2:3", "--out", str(out)]
    env = {**{k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")},
           "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    proc = subprocess.run([sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [int(c) for c in re.findall(r"^step \d+: loss [\d.]+, compiled (\d+)$", proc.stdout, re.M)] == [1, 0, 0]
    assert "check passed" in proc.stdout and "https://ui.perfetto.dev" in proc.stdout
    traces = list((out / "profile").rglob("*.trace.json.gz"))
    assert len(traces) == 1, list((out / "profile").rglob("*"))
    names = {e.get("name") for e in json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
