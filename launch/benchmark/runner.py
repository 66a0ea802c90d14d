"""The parent side of `launch/bench.py`: time the variants, run measurements in child processes, report."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from .jax_baseline import initial_losses
from .report import markdown_section, update_markdown
from .summary import results
from .timing import matmul_peaks, time_round_robin
from .variants import build_variant, default_variants

__all__ = ["CHILD_TAG", "compile_times", "run", "run_child"]

CHILD_TAG = "BENCH_CHILD_RESULT "


def run_child(argv, what, env=None):
    """Run `launch/bench.py` with the same flags plus `--child what` in a fresh process; return its JSON result."""
    extra = env or {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", **extra}  # freed tensors leave RSS at once
    if env.pop("EMBER_BENCH_FRESH_CACHE", None) and "TORCHINDUCTOR_CACHE_DIR" not in extra:
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # each child compiles cold in its own cache
    proc = subprocess.run([sys.executable, "-m", "ember.launch.bench", *argv, "--child", what], env=env,
                          capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG):])
    raise RuntimeError(f"bench child {what!r} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def compile_times(argv, names):
    """`{variant: {cold_s, warm_s}}`: first call in a fresh process on an empty cache, then on that cache."""
    out = {}
    for name in names:
        cache = tempfile.mkdtemp(prefix="ember_bench_compile_")
        try:
            env = {"TORCHINDUCTOR_CACHE_DIR": cache}
            runs = [run_child(argv, f"first_call:{name}", env=env)["first_call_s"] for _ in range(2)]
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        out[name] = {"cold_s": runs[0], "warm_s": runs[1]}
        print(f"{name}: first call {runs[0]:.1f} s cold, {runs[1]:.1f} s with a warm cache", flush=True)
    return out


def run(args, argv, s):
    """Time every variant, optionally measure memory and ember_xla, report; returns the results dict."""
    names = args.variants.split(",") if args.variants else default_variants(s.device)
    want_xla = "ember_xla" in names
    names = [n for n in names if n != "ember_xla"]
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    iters = args.iters if args.iters is not None else (3 if args.quick else 20)
    initial = initial_losses(s, jax="jax" in names)
    if "jax" in names:
        print(f"initial loss: ember {initial['ember']:.6f}, jax {initial['jax']:.6f}, |diff| {initial['abs_diff']:.2e}"
              + ("" if initial["abs_diff"] <= 1e-4 else "  MISMATCH (> 1e-4)"), flush=True)
    variants = [build_variant(n, s) for n in names]
    dtypes = {v.name: v.dtype for v in variants}  # each variant's MFU is against its own dtype's peak
    peaks = matmul_peaks(s.device, sorted(set(dtypes.values())))
    timed = time_round_robin(variants, warmup=warmup, iters=iters)
    again = matmul_peaks(s.device, list(peaks))  # again: the machine is shared
    peaks = {d: max(p, again[d], key=lambda x: x["flops"]) for d, p in peaks.items()}
    res = results(s, timed, peaks=peaks, dtypes=dtypes, warmup=warmup, iters=iters, config=args.config, initial_loss=initial,
                  title=args.title or args.config, command="python launch/bench.py " + shlex.join(argv),
                  notes={v.name: v.notes for v in variants})
    if args.memory:
        mem = names if args.memory == "all" else args.memory.split(",")
        res["memory"] = {n: run_child(argv, f"memory:{n}") for n in mem}
    if args.compile_times:
        res["compile_times"] = compile_times(argv, names if args.compile_times == "all" else args.compile_times.split(","))
    if want_xla:
        x = res["ember_xla"] = run_child(argv, "xla", env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"})
        print(f"ember_xla: {x['compiles_first_call']} compile(s) in the first call, "
              f"{x['compiles_after_first_call']} more over {x['steps']} steps", flush=True)
    section = markdown_section(res)
    print(section)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if args.markdown:
        update_markdown(args.markdown, section)
    return res
