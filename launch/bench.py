"""Benchmark ember's training step against idiomatic PyTorch and plain JAX on the same model.

    python launch/bench.py --quick                                   # llama3_tiny smoke run (make bench)
    python launch/bench.py --config llama3_tiny --memory --json /tmp/b_tiny.json --markdown BENCHMARKS.md
    python launch/bench.py --config llama3_125m --data.batch_size 1 --data.seq_len 256 --iters 5
    python launch/bench.py --variants ember_inductor_donated,torch_compiled,ember_xla --model.n_layers 1

Variants (same weights, batch and AdamW hyperparameters, constant lr, clipping at 1.0), timed
round-robin in one process after warm-up: `ember_inductor_donated`, `ember_eager`, `torch_compiled`
(baseline: `torch.compile(module)` + `torch.optim.AdamW`), `torch_eager`, `jax` (jax.jit + optax);
on a GPU also `ember_inductor_bf16`, `torch_compiled_bf16`. Optional: `ember_inductor` (no
donation), `torch_compiled_foreach`, `ember_xla` (torch_xla on a virtual CPU device, own process),
`ember_inductor_cudagraph` / `ember_inductor_bf16_cudagraph` (the donated step replayed as one CUDA
graph; a GPU only), `ember_inductor_list` / `ember_inductor_bf16_list` (the blocks as a list,
`scan_layers=False`, instead of stacked). The torch baselines run the blocks as a list, as an
`nn.ModuleList` would. Each row's MFU is against the measured matmul peak of its own dtype (float32 rows:
float32, TF32 on CUDA unless `--tf32 False`; bf16 rows: bf16), named in the JSON row (`peak_dtype`).
`--memory` measures transient memory at peak in a fresh process per variant. Any config field is
a dotted override (`--model.n_layers 1`). Reusable pieces live in `ember.launch.benchmark`.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile


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

        from ember.launch.benchmark import CHILD_TAG, build_setup, first_call_child, memory_child, run, xla_child
        from ember.launch.precision import set_matmul_precision
        from ember.launch.run_config import parse_cli
        from ember.models.layers.attention_kernel import attention_kernel_report

        cfg = parse_cli(args.config, overrides, description=__doc__)
        on_gpu = torch.cuda.is_available() and args.child != "xla"
        s = build_setup(cfg, device=torch.device("cuda" if on_gpu else "cpu"), init=args.init)
        set_matmul_precision(cfg.tf32, s.device)  # float32 rows run (and their peak is measured) as --tf32 says
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
        for dtype in (None, torch.bfloat16) if on_gpu else (None,):  # the SDPA kernel the step's attention runs
            print(attention_kernel_report(s.model, s.params, seq_len=cfg.data.seq_len, device=s.device, dtype=dtype))
        return run(args, argv, s)
    finally:
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            os.environ.pop("EMBER_BENCH_FRESH_CACHE", None)


if __name__ == "__main__":
    main()
