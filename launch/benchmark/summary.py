"""The results dict `launch/bench.py` writes as JSON: setup, machine, peak, FLOPs, per-variant summary.

Public names: `flops_per_token`, `machine_info`, `summarize`, `results`.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from typing import Any, Dict

import torch

from ember.core.pytree import tree_leaves

from .setup import Setup
from .timing import percentile


def flops_per_token(s: Setup) -> Dict[str, float]:
    """Training FLOPs per token, `6 N + 12 L d T` (PaLM, Chowdhery et al. 2022, appendix B).

    N counts the parameters that take part in a matmul: all except learned position tables and an
    untied input embedding (a lookup). 12 L d T is attention's QK^T and AV (forward + backward),
    counted without causal halving, as PaLM does.
    """
    c = s.cfg.model
    n = sum(t.numel() for t in tree_leaves(s.params))
    n -= s.params["wpe"]["weight"].numel() if "wpe" in s.params else 0
    n -= s.params["wte"]["weight"].numel() if "lm_head" in s.params else 0
    return {"n_matmul_params": n, "flops_per_token": 6 * n + 12 * c.n_layers * c.d_model * s.cfg.data.seq_len}


def machine_info() -> Dict[str, Any]:
    """Platform, torch version, CPU count, GPU name, date, and how bench.py set up glibc's malloc."""
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "malloc": os.environ.get("EMBER_BENCH_MALLOC", "default"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}


def summarize(timed: Dict[str, Dict[str, Any]], *, tokens: int, flops_tok: float, peaks: Dict[str, Dict[str, Any]],
              dtypes: Dict[str, str], baseline: str) -> Dict[str, Dict[str, Any]]:
    """Per variant: median/IQR ms, tokens/s, FLOP/s, MFU, ratio to `baseline`, first-call seconds, losses.

    Each variant's MFU is against the measured peak of the dtype its matmuls compute in (`dtypes[name]`,
    float32 when absent): float32 rows against the float32 (TF32 on CUDA) peak, bf16 rows against bf16.
    The row names that peak (`peak_dtype`, `peak_flops`, `peak_matmul`).
    """
    out = {}
    for name, r in timed.items():
        med = statistics.median(r["times"])
        peak = peaks[dtypes.get(name, "float32")]
        out[name] = {"median_ms": 1e3 * med, "p25_ms": 1e3 * percentile(r["times"], 0.25),
                     "p75_ms": 1e3 * percentile(r["times"], 0.75), "tokens_per_s": tokens / med,
                     "flops_per_s": flops_tok * tokens / med, "mfu": flops_tok * tokens / med / peak["flops"],
                     "peak_dtype": peak["dtype"], "peak_flops": peak["flops"], "peak_matmul": peak["matmul"],
                     "first_call_s": r["first_call_s"], "first_loss": r["first_loss"],
                     "last_loss": r["last_loss"], "times_ms": [1e3 * t for t in r["times"]]}
    base = out.get(baseline)
    for r in out.values():
        r["ratio_vs_baseline"] = r["median_ms"] / base["median_ms"] if base else None
    return out


def results(s: Setup, timed: Dict[str, Dict[str, Any]], *, peaks: Dict[str, Dict[str, Any]],
            dtypes: Dict[str, str], **extra: Any) -> Dict[str, Any]:
    """The results dict written as JSON: setup, machine, peaks (one per dtype), FLOPs, the per-variant summary."""
    fl = flops_per_token(s)
    tokens = s.cfg.data.batch_size * s.cfg.data.seq_len
    baseline = "torch_compiled" if "torch_compiled" in timed else next(iter(timed))
    return {**extra, "machine": machine_info(), "model": f"{s.cfg.family} {s.cfg.model}", "init": s.init,
            "n_params": sum(t.numel() for t in tree_leaves(s.params)), "batch": s.cfg.data.batch_size,
            "seq_len": s.cfg.data.seq_len, "tokens_per_step": tokens, "device": str(s.device), "peaks": peaks,
            **fl, "baseline": baseline,
            "variants": summarize(timed, tokens=tokens, flops_tok=fl["flops_per_token"], peaks=peaks, dtypes=dtypes,
                                  baseline=baseline)}
