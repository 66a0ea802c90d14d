"""How long steps take: round-robin timing of variants, the matmul peak, percentiles.

Public names: `time_round_robin`, `matmul_peak`, `matmul_peaks`, `percentile`.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from .setup import Variant, sync


def time_round_robin(variants: List[Variant], *, warmup: int, iters: int) -> Dict[str, Dict[str, Any]]:
    """First call (cold compile) of each, `warmup` more rounds, then `iters` rounds with rotating order."""
    out: Dict[str, Dict[str, Any]] = {}
    for v in variants:
        t0 = time.perf_counter()
        loss = float(v.step())  # host sync
        out[v.name] = {"first_call_s": time.perf_counter() - t0, "first_loss": loss, "times": []}
    for _ in range(warmup):
        for v in variants:
            v.step()
    gc.collect()
    for i in range(iters):
        for v in variants[i % len(variants):] + variants[: i % len(variants)]:
            t0 = time.perf_counter()
            v.step()
            out[v.name]["times"].append(time.perf_counter() - t0)
    for v in variants:  # one more step each: the loss after the same number of steps
        out[v.name]["last_loss"] = float(v.step())
    return out


def matmul_peak(device: torch.device, *, reps: int = 10, dtype: Optional[torch.dtype] = None,
                n: Optional[int] = None) -> Dict[str, Any]:
    """Best achieved FLOP/s of a large `dtype` matmul over `reps` tries: `{"flops", "matmul", "dtype"}`.

    `dtype` defaults to bf16 on a GPU and float32 on the CPU; `n` to 8192 on a GPU, 2048 (float32) or
    1024 (other dtypes) on the CPU. A float32 matmul on CUDA runs as torch's matmul precision says
    (TF32 under "high"/"medium", as `--tf32 True` sets), and its label says which. On a shared
    machine any one try can be slowed by other processes; the best one is the peak.
    """
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    n = n or (8192 if device.type == "cuda" else 2048 if dtype == torch.float32 else 1024)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync(device)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    name = str(dtype).replace("torch.", "")
    tf32 = device.type == "cuda" and dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
    return {"flops": 2 * n**3 / best, "matmul": f"{n}x{n}x{n} {name}{' (TF32)' if tf32 else ''}", "dtype": name}


def matmul_peaks(device: torch.device, dtypes: Sequence[str], *, reps: int = 10) -> Dict[str, Dict[str, Any]]:
    """`{dtype name: matmul_peak(...)}` for each dtype (e.g. "float32", "bfloat16"): each variant's own peak."""
    return {name: matmul_peak(device, reps=reps, dtype=getattr(torch, name)) for name in dtypes}


def percentile(xs: List[float], q: float) -> float:
    """The `q`-quantile (0..1) of `xs`, linearly interpolated."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
