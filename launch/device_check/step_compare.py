"""Stages b1/b2: ember's compiled step against `torch.compile(module)` + fused AdamW on one model, in one process.

    python -m ember.launch.device_check.step_compare --phase cold --config llama3_125m \
        --variants torch_compiled_bf16,ember_inductor_bf16 --warmup 2 --iters 10 [config overrides]
    python -m ember.launch.device_check.step_compare --phase warm ...   # a second process, same cache

The variants are `launch/bench.py`'s (`ember.launch.benchmark.VARIANTS`): same weights, batch and
AdamW hyperparameters. `cold` (run on an empty `TORCHINDUCTOR_CACHE_DIR`): each variant's first
call (build + trace + compile + one step), printed as soon as it ends so a later hang keeps it; then
round-robin steady steps (median ms, tokens/s, MFU against the measured matmul peak) and each
variant's peak memory during one step. `warm`: only the first calls, on the cache `cold` filled.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
import traceback
from typing import Any, Dict, List

import torch

from ember.core import device_for
from ember.core.pytree import tree_leaves
from ember.launch.benchmark import build_setup, build_variant, flops_per_token, matmul_peaks
from ember.launch.benchmark.children import memory_peak
from ember.launch.benchmark.timing import percentile
from ember.launch.run_config import parse_cli

from .common import emit

GIB = 2**30


def _cache_files() -> int:
    """Files in Inductor's cache directory now (0: the first calls below compile cold)."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return sum(len(files) for _, _, files in os.walk(root)) if root and os.path.isdir(root) else -1


def _first_call(v: Any, phase: str, profile: bool = False) -> Dict[str, Any]:
    """Seconds to the end of the first step and, on a GPU, the memory it took beyond what was held before:
    a CUDA graph's pool is allocated then (its replays allocate nothing), so this is its transient memory.
    `profile`: the call under cProfile, its 30 costliest functions (cumulative) printed to the log."""
    losses, cuda = [], torch.cuda.is_available()
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    base, peak = memory_peak(lambda: losses.append(float(v.step())), cuda=cuda)  # float(): a host sync
    if profiler:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(30)
    out = {"variant": v.name, "phase": phase, "first_call_s": round(time.perf_counter() - t0, 2),
           "first_loss": losses[0]}
    if cuda:
        out["first_call_transient_gib"] = round((peak - base) / GIB, 3)
    emit("compare_first_call", out)
    return out


def _steady(variants: List[Any], *, warmup: int, iters: int) -> Dict[str, List[float]]:
    """Seconds per step of each variant, `iters` rounds in rotating order after `warmup` rounds."""
    for _ in range(warmup):
        for v in variants:
            v.step()
    gc.collect()
    times: Dict[str, List[float]] = {v.name: [] for v in variants}
    for i in range(iters):
        for v in variants[i % len(variants):] + variants[: i % len(variants)]:
            t0 = time.perf_counter()
            v.step()
            times[v.name].append(time.perf_counter() - t0)
    return times


def _memory(v: Any, cuda: bool) -> Dict[str, Any]:
    try:
        base, peak = memory_peak(v.step, cuda=cuda)
    except OSError as e:  # a CPU host that refuses /proc/self/clear_refs: no figure, the rest stands
        return {"error": f"{type(e).__name__}: {e}"}
    return {"state_gib": v.state_bytes() / GIB, "held_before_step_gib": base / GIB, "peak_gib": peak / GIB,
            "transient_gib": (peak - base) / GIB, "kind": "cuda max_memory_allocated" if cuda else "cpu VmHWM"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=["cold", "warm"], default="cold")
    p.add_argument("--config", default="llama3_125m")
    p.add_argument("--variants", default="torch_compiled_bf16,ember_inductor_bf16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--peak-reps", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="each first call under cProfile (the log gets its top 30)")
    args, overrides = p.parse_known_args(argv)
    res: Dict[str, Any] = {"phase": args.phase, "torch": torch.__version__, "config": args.config,
                           "overrides": overrides, "cache_files_at_start": _cache_files()}
    try:
        cfg, device = parse_cli(args.config, overrides), device_for("inductor")
        s = build_setup(cfg, device=device)
        tokens = cfg.data.batch_size * cfg.data.seq_len
        res.update(device=str(device), gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
                   batch=cfg.data.batch_size, seq_len=cfg.data.seq_len, init=s.init,
                   n_params=sum(x.numel() for x in tree_leaves(s.params)), first_calls={})
        variants, res["failed"] = [], {}
        for name in args.variants.split(","):
            try:  # one variant that fails (a CUDA graph's capture, say) leaves the others' figures
                v = build_variant(name, s)
                res["first_calls"][name] = _first_call(v, args.phase, args.profile)
            except Exception as e:  # noqa: BLE001 - reported on the result line, the stage fails at its end
                res["failed"][name] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc()
                continue
            if args.phase == "warm":
                del v  # the next variant's first call and memory start from the setup alone
                gc.collect()
            else:
                variants.append(v)
        if args.phase == "cold":
            peaks = matmul_peaks(device, sorted({v.dtype for v in variants}), reps=args.peak_reps)
            times = _steady(variants, warmup=args.warmup, iters=args.iters)
            fpt = flops_per_token(s)["flops_per_token"]
            top = max(peaks.values(), key=lambda p: p["flops"])  # the headline peak (bf16 when a row computes in it)
            res.update(peak_tflops=top["flops"] / 1e12, peak_matmul=top["matmul"], flops_per_token=fpt,
                       warmup=args.warmup, iters=args.iters, steady={})
            for v in variants:
                med, peak = percentile(times[v.name], 0.5), peaks[v.dtype]  # each row against its own dtype's peak
                res["steady"][v.name] = {"median_ms": 1e3 * med, "p25_ms": 1e3 * percentile(times[v.name], 0.25),
                                         "p75_ms": 1e3 * percentile(times[v.name], 0.75),
                                         "tokens_per_s": tokens / med, "mfu": fpt * tokens / med / peak["flops"],
                                         "peak_dtype": v.dtype,
                                         "memory": _memory(v, device.type == "cuda"), "last_loss": float(v.step())}
    except Exception as e:  # noqa: BLE001 - the stage reports any failure on its result line
        res["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    emit("compare", res)
    return 1 if "error" in res or res.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
