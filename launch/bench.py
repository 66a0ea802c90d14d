"""Benchmark ember's training step against idiomatic PyTorch and plain JAX on the same model.

    python launch/bench.py --quick                                   # llama3_tiny smoke run (make bench)
    python launch/bench.py --config llama3_tiny --memory --json /tmp/b_tiny.json --markdown BENCHMARKS.md
    python launch/bench.py --config llama3_125m --data.batch_size 1 --data.seq_len 256 --iters 5
    python launch/bench.py --variants ember_inductor_donated,torch_compiled,ember_xla --model.n_layers 1

Variants (same weights, batch and AdamW hyperparameters, constant lr, clipping at 1.0), timed
round-robin in one process after warm-up: `ember_inductor_donated`, `ember_eager`, `torch_compiled`
(baseline: `torch.compile(module)` + `torch.optim.AdamW`), `torch_eager`, `jax` (jax.jit + optax);
on a GPU also `ember_inductor_bf16`, `torch_compiled_bf16`. Optional: `ember_inductor` (no
donation), `torch_compiled_foreach`, `ember_xla` (torch_xla on a virtual CPU device, own process).
`--memory` measures transient memory at peak in a fresh process per variant. Any config field is
a dotted override (`--model.n_layers 1`). Reusable pieces live in `ember.launch.benchmark`.
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

CHILD_TAG = "BENCH_CHILD_RESULT "


def parse_args(argv):
    """Split the benchmark's own flags from the config overrides (passed to `parse_cli`)."""
    p = argparse.ArgumentParser(description="Benchmark ember's training step.")
    p.add_argument("--config", default="llama3_tiny", help="registered run config")
    p.add_argument("--json", help="write all results to this JSON file")
    p.add_argument("--markdown", help="replace this config's section in a Markdown file (BENCHMARKS.md)")
    p.add_argument("--title", help="section title in --markdown (default: the config name)")
    p.add_argument("--quick", action="store_true", help="tiny warm-up and iteration counts (CI smoke)")
    p.add_argument("--variants", help="comma-separated variant names (default: see module docstring)")
    p.add_argument("--memory", nargs="?", const="all", help="transient memory at peak, fresh process per variant "
                   "(all timed variants, or a comma-separated subset)")
    p.add_argument("--warmup", type=int, help="warm-up rounds after the first call (default 3, quick 1)")
    p.add_argument("--iters", type=int, help="timed rounds (default 20, quick 3)")
    p.add_argument("--xla-steps", type=int, help="timed ember_xla steps (default 50, quick 5)")
    p.add_argument("--init", choices=["auto", "ember", "fast"], default="auto",
                   help="param init: ember's, or a seeded torch.randn one (auto: fast above 20M params)")
    p.add_argument("--threads", type=int, help="CPU threads for torch and XLA:CPU (default: torch's own choice)")
    p.add_argument("--warm-cache", action="store_true", help="keep Inductor's on-disk cache (first calls not cold)")
    p.add_argument("--default-malloc", action="store_true", help="leave glibc's malloc as it is (by default freed "
                   "memory stays in the process, as in launch/train.py: ember.launch.host_memory)")
    p.add_argument("--compile-times", nargs="?", const="all", help="first-call time per variant in fresh "
                   "processes: cold (empty compile cache), then warm (the cache the cold one filled)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # memory:<variant> or xla (internal)
    return p.parse_known_args(argv)


def run_child(argv, what, env=None):
    """Run this script with the same flags plus `--child what` in a fresh process; return its JSON result."""
    extra = env or {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", **extra}  # freed tensors leave RSS at once
    if env.pop("EMBER_BENCH_FRESH_CACHE", None) and "TORCHINDUCTOR_CACHE_DIR" not in extra:
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # each child compiles cold in its own cache
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--child", what], env=env,
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
    from ember.launch.benchmark import (build_variant, default_variants, initial_losses, markdown_section,
                                        matmul_peak, results, time_round_robin, update_markdown)

    names = args.variants.split(",") if args.variants else default_variants(s.device)
    want_xla = "ember_xla" in names
    names = [n for n in names if n != "ember_xla"]
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    iters = args.iters if args.iters is not None else (3 if args.quick else 20)
    initial = initial_losses(s, jax="jax" in names)
    if "jax" in names:
        print(f"initial loss: ember {initial['ember']:.6f}, jax {initial['jax']:.6f}, |diff| {initial['abs_diff']:.2e}"
              + ("" if initial["abs_diff"] <= 1e-4 else "  MISMATCH (> 1e-4)"), flush=True)
    peak = matmul_peak(s.device)
    variants = [build_variant(n, s) for n in names]
    timed = time_round_robin(variants, warmup=warmup, iters=iters)
    peak = max(peak, matmul_peak(s.device), key=lambda p: p["flops"])  # again: the machine is shared
    res = results(s, timed, peak=peak, warmup=warmup, iters=iters, config=args.config, initial_loss=initial,
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = parse_args(argv)
    # Memory children keep glibc's default: RSS must fall back when temporaries are freed, or the
    # held-state baseline would count freed memory and the transient figure would shrink.
    if not args.default_malloc and not (args.child or "").startswith("memory"):
        from ember.launch.host_memory import retain_freed_host_memory

        kept = retain_freed_host_memory()  # every timed variant runs under it: they share this process
        os.environ["EMBER_BENCH_MALLOC"] = "keeps freed memory" if kept else "default"
    fresh = None
    if not args.warm_cache and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        fresh = tempfile.mkdtemp(prefix="ember_bench_inductor_")  # cold compiles: no cached kernels
        os.environ.update(TORCHINDUCTOR_CACHE_DIR=fresh, EMBER_BENCH_FRESH_CACHE="1")
    if args.threads and "intra_op_parallelism" not in os.environ.get("XLA_FLAGS", ""):  # read when XLA:CPU starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_cpu_multi_thread_eigen="
                                   f"{str(args.threads > 1).lower()} intra_op_parallelism_threads={args.threads}")
    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)

        from ember.launch.benchmark import build_setup, first_call_child, memory_child, xla_child
        from ember.launch.run_config import parse_cli

        cfg = parse_cli(args.config, overrides, description=__doc__)
        on_gpu = torch.cuda.is_available() and args.child != "xla"
        s = build_setup(cfg, device=torch.device("cuda" if on_gpu else "cpu"), init=args.init)
        if args.child:
            kind, _, name = args.child.partition(":")
            steps = args.xla_steps or (5 if args.quick else 50)
            if kind == "memory":
                out = memory_child(s, name)
            elif kind == "first_call":
                out = first_call_child(s, name)
            else:
                out = xla_child(s, steps=steps)
            print(CHILD_TAG + json.dumps(out), flush=True)
            return out
        return run(args, argv, s)
    finally:
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            os.environ.pop("EMBER_BENCH_FRESH_CACHE", None)


if __name__ == "__main__":
    main()
