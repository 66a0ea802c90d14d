"""Measurements that need a fresh process: transient memory, first-call time, and ember under torch_xla.

Public names: `memory_child`, `memory_peak`, `first_call_child`, `xla_child`, `rss_bytes`.

`launch/bench.py --child ...` runs one of these and prints its dict as JSON on stdout.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable, Dict, Tuple

import torch

from ember.core import TrainState, jit, random
from ember.core.pytree import tree_map
from ember.core.step_fns import train_step
from ember.models import lm_loss
from ember.optim.config import from_config

from .setup import Setup, bench_optim_config
from .timing import percentile
from .variants import build_variant


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def memory_child(s: Setup, name: str, *, warmup: int = 2, steps: int = 3) -> Dict[str, Any]:
    """Transient memory at peak of variant `name`: peak during steady steps minus what is held between them.

    CPU: the kernel's RSS high-water mark (`VmHWM`), reset after the compile and warm-up steps, minus
    RSS after warm-up with gradients freed. GPU: `max_memory_allocated` after
    `reset_peak_memory_stats`, minus `memory_allocated`.
    """
    # Resetting VmHWM (`/proc/self/clear_refs` = 5) keeps compiler memory out of the peak; the
    # parent runs this under a fixed `MALLOC_MMAP_THRESHOLD_`, so freed tensors leave RSS.
    # `getrusage(RUSAGE_SELF).ru_maxrss` cannot serve: it counts the compiler's peak, and Linux
    # carries it across fork + exec (a child reports its parent's peak).
    rss_start = rss_bytes()
    v = build_variant(name, s)
    rss_state = rss_bytes()
    first = time.perf_counter()
    v.step()
    first = time.perf_counter() - first
    for _ in range(warmup):
        v.step()
    v.clear()
    gc.collect()
    out: Dict[str, Any] = {"variant": name, "state_bytes": v.state_bytes(), "rss_before_state": rss_start,
                           "rss_after_state": rss_state, "first_call_s": first}
    cuda = v.device == "cuda"
    base, peak = memory_peak(lambda: [v.step() for _ in range(steps)], cuda=cuda)
    out.update(kind="cuda_allocated" if cuda else "cpu_rss", baseline_bytes=base, peak_bytes=peak,
               transient_bytes=peak - base)
    return out


def memory_peak(run: Callable[[], Any], *, cuda: bool) -> Tuple[int, int]:
    """`(bytes held before run(), peak bytes during it)`: CUDA allocator stats, or RSS and VmHWM on CPU."""
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = rss_bytes()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    run()
    if cuda:
        torch.cuda.synchronize()
    return base, torch.cuda.max_memory_allocated() if cuda else rss_bytes("VmHWM")


def first_call_child(s: Setup, name: str) -> Dict[str, Any]:
    """Seconds from building variant `name` to the end of its first step (trace, compile or cache load, run)."""
    start = time.perf_counter()
    build_variant(name, s).step()
    return {"variant": name, "first_call_s": time.perf_counter() - start}


def xla_child(s: Setup, *, steps: int) -> Dict[str, Any]:
    """ember's step under `backend="xla"` with a warmup-cosine lr: compile count/time and steady step time."""
    import torch_xla

    from ember.core import xla

    dev = torch_xla.device()  # start the runtime before any backward pass
    tx = from_config(bench_optim_config(s.cfg, "warmup_cosine"), total_steps=steps + 1)
    state = TrainState.create(params=tree_map(lambda x: x.to(dev), s.params), tx=tx, key=random.key(s.cfg.seed, device=dev))
    batch = tree_map(lambda x: x.to(dev), s.batch)
    step = jit(train_step(lm_loss(s.model), skip_nonfinite=True), backend="xla", donate="state")
    c0 = xla.compile_count()
    t0 = time.perf_counter()
    state, m = step(state, batch)
    first_loss, lrs = float(m["loss"].cpu()), [float(m["lr"].cpu())]  # host sync
    first = time.perf_counter() - t0
    after_first, global_after_first = step.compile_count, xla.compile_count() - c0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        lrs.append(float(m["lr"].cpu()))  # host sync: waits for the step
        times.append(time.perf_counter() - t0)
    return {"first_call_s": first, "first_loss": first_loss, "last_loss": float(m["loss"].cpu()),
            "compiles_first_call": after_first, "compiles_after_first_call": step.compile_count - after_first,
            "xla_compiles_global_first": global_after_first,
            "xla_compiles_global_after": xla.compile_count() - c0 - global_after_first,
            "steps": steps, "median_ms": 1e3 * statistics.median(times), "p25_ms": 1e3 * percentile(times, 0.25),
            "p75_ms": 1e3 * percentile(times, 0.75), "lr_first": lrs[0], "lr_max": max(lrs), "lr_last": lrs[-1]}
