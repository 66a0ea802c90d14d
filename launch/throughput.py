"""Throughput of a run: FLOPs of one training step, the device's peak, MFU, step time and peak memory.

Public names: `Throughput`, `step_flops`, `active_flops_config`, `peak_flops`, `peak_memory_gib`,
`THROUGHPUT_KEYS`.

`train_loop` adds these keys to every logged row (`metrics.jsonl`, TensorBoard and every tracker):

    throughput/tokens_per_s   tokens of the steps since the last log / wall time since it
    throughput/mfu            flops_per_step / (step_s * n_devices * peak_flops_per_device)
    time/step_s               wall time per step since the last log (from one log's host sync to the next)
    time/data_wait_s          of it, time spent in `next(batches)`
    time/compute_s            the rest: the step, its launch, checkpoint hooks
    memory/peak_gib           peak memory of this process's device: CUDA `max_memory_allocated` over the log
                              interval (reset at each log); the CPU: the process's peak RSS so far (run max)

FLOPs are counted once, at the first step: the pure (uncompiled) step runs on fake tensors shaped like the
state and the first batch under `torch.utils.flop_counter.FlopCounterMode` (no memory, no real compute).
The peak is NVIDIA's dense datasheet figure for known GPUs in the compute dtype (bf16/fp16, TF32, fp32);
on the CPU or an unknown device it is measured once: the best of a few large matmuls in that dtype.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ember.core.flop_count import count_flops

__all__ = ["THROUGHPUT_KEYS", "Throughput", "active_flops_config", "peak_flops", "peak_memory_gib",
           "step_flops"]

THROUGHPUT_KEYS = ("throughput/tokens_per_s", "throughput/mfu", "time/step_s", "time/data_wait_s", "time/compute_s",
                   "memory/peak_gib")
"""The keys `train_loop` adds to a logged row; they change from run to run (compare model metrics without them)."""

# Dense (no sparsity) peak TFLOP/s per GPU from NVIDIA's datasheets: (name fragment, bf16/fp16, tf32, fp32).
# Checked in this order: a longer name first (L40S before L4, A100 before A10, H100 PCIe / NVL before H100).
_GPU_PEAK_TFLOPS: Tuple[Tuple[str, float, float, float], ...] = (
    ("GB200", 2500.0, 1250.0, 80.0),
    ("B200", 2250.0, 1100.0, 75.0),
    ("H200", 989.4, 494.7, 66.9),
    ("H100 PCIe", 756.0, 378.0, 51.2),
    ("H100 NVL", 835.0, 417.5, 60.0),
    ("H100", 989.4, 494.7, 66.9),  # SXM
    ("H800", 989.4, 494.7, 66.9),
    ("GH200", 989.4, 494.7, 66.9),
    ("A100", 312.0, 156.0, 19.5),
    ("A800", 312.0, 156.0, 19.5),
    ("L40S", 362.05, 183.0, 91.6),
    ("L40", 181.05, 90.5, 90.5),
    ("L4", 121.0, 60.0, 30.3),
    ("A10G", 70.0, 35.0, 31.2),  # AWS's A10G: about half the A10's tensor rate
    ("A10", 125.0, 62.5, 31.2),
    ("RTX 4090", 165.2, 82.6, 82.6),
    ("V100", 125.0, 15.7, 15.7),  # fp16 tensor cores; no bf16, no TF32
)


def active_flops_config(cfg: Any) -> Any:
    """`cfg` with each MoE expert given exactly its routed share of slots, for counting active FLOPs.

    A dropless MoE layer that runs padded (torch_xla, or where the grouped kernel cannot run) gives every
    expert a slot per token: its matmuls cost `E / k` times the routed (token, expert) pairs', and the grouped
    kernel (`torch._grouped_mm`) is not in `FlopCounterMode`'s table at all (it would count 0). A capacity
    factor of 1 makes each expert's slots `ceil(S * k / E)`, so the experts' matmuls are counted for the `k * S`
    pairs a sequence of `S` tokens routes, as a model's active parameters do (exactly when `E` divides `S * k`;
    at most `E - 1` slots more per sequence otherwise). Dense configs come back unchanged.
    """
    model = getattr(cfg, "model", None)
    if model is None or not dataclasses.is_dataclass(model) or not hasattr(model, "capacity_factor"):
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(model, capacity_factor=1.0))


def step_flops(cfg: Any) -> Callable[[Any, Any], int]:
    """`(state, batch) -> FLOPs` of one training step of run config `cfg`, counting an MoE's active experts.

    The step is `ember.launch.build.step_fn` of `active_flops_config(cfg)`, uncompiled, on fake tensors: the
    count is what `FlopCounterMode` gives for the same step run eagerly on real tensors (`tests/launch/test_flops.py`).
    """
    from ember.launch import build  # here: build imports the run config, which imports this package's modules

    counted = active_flops_config(cfg)
    fn = build.step_fn(counted, build.build_model(counted))
    return lambda state, batch: count_flops(fn, state, batch)


def _peak_column(dtype: Optional[torch.dtype], tf32: bool) -> int:
    if dtype in (torch.bfloat16, torch.float16):
        return 1
    return 2 if tf32 else 3


def _measured_peak(device: torch.device, dtype: torch.dtype, *, size: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of the best of `repeats` `(size, size) @ (size, size)` matmuls in `dtype` on `device`."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    (a @ b).sum().item()  # host sync: warm the kernel before timing
    for _ in range(repeats):
        started = time.perf_counter()
        (a @ b).sum().item()  # host sync: the matmul is done when the clock stops
        best = min(best, time.perf_counter() - started)
    return 2.0 * size ** 3 / best


def peak_flops(device: Any, dtype: Optional[torch.dtype] = None, *, tf32: bool = False) -> Tuple[float, str]:
    """`(peak FLOP/s of one device, where the figure comes from)` for matmuls in `dtype` (None: float32).

    A CUDA GPU in the datasheet table gives its dense figure (bf16/fp16; float32 with `tf32` on: TF32); the
    CPU, torch_xla and any other device get a measured one (large matmuls, timed once).
    """
    device = torch.device(device)
    dtype = torch.float32 if dtype is None else dtype
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, *tflops in _GPU_PEAK_TFLOPS:
            if fragment.lower() in name.lower():
                return tflops[_peak_column(dtype, tf32) - 1] * 1e12, f"{name} datasheet"
    return _measured_peak(device, dtype), f"measured on {device.type}"


def peak_memory_gib(device: Any, *, reset: bool = True) -> Optional[float]:
    """Peak memory of this process on `device` in GiB, or None where it cannot be read.

    CUDA: `torch.cuda.max_memory_allocated` since the last reset (reset after reading when `reset`: a peak
    per log interval). The CPU: the process's peak resident set (`getrusage`), a run maximum. torch_xla: the
    device's `peak_bytes_used` (`xm.get_memory_info`) where the runtime reports it.
    """
    device = torch.device(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak / 2 ** 30
    if device.type == "cpu":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return rss / (2 ** 30 if sys.platform == "darwin" else 2 ** 20)
    if device.type == "xla":
        try:
            import torch_xla.core.xla_model as xm

            info = xm.get_memory_info(device)
            peak = info.get("peak_bytes_used", info.get("bytes_used"))
            return None if peak is None else peak / 2 ** 30
        except Exception:  # a runtime without memory stats (the CPU client)
            return None
    return None


class Throughput:
    """The throughput, time and memory keys of each logged row (`THROUGHPUT_KEYS`).

    Args:
        tokens_per_step: tokens in one step's batch (0: no `throughput/tokens_per_s`).
        device: the device the step runs on (peak memory, and the measured peak when not in the table).
        flops: `(state, batch) -> FLOPs of one step` (`step_flops(cfg)`), called once at the first step;
            None: no `throughput/mfu`.
        peak: peak FLOP/s of one device; None: `peak_flops(device, dtype, tf32=tf32)` at the first step.
        n_devices: devices the step runs on (the FLOPs are of the whole step).
        dtype: the compute dtype of the step's matmuls (None: float32).
        tf32: float32 matmuls run on TF32 tensor cores (CUDA).
    """

    def __init__(self, *, tokens_per_step: int = 0, device: Any = "cpu",
                 flops: Optional[Callable[[Any, Any], int]] = None, peak: Optional[float] = None,
                 n_devices: int = 1, dtype: Optional[torch.dtype] = None, tf32: bool = False) -> None:
        self.tokens_per_step, self.device, self.n_devices = tokens_per_step, torch.device(device), n_devices
        self._flops, self._dtype, self._tf32 = flops, dtype, tf32
        self.flops_per_step: Optional[int] = None
        self.peak, self.peak_source = peak, "given" if peak is not None else ""

    def start(self, state: Any, batch: Any) -> None:
        """Count the step's FLOPs and find the peak (once, before the first step: the state is not donated yet)."""
        if self._flops is not None and self.flops_per_step is None:
            try:
                self.flops_per_step = self._flops(state, batch)
            except Exception as error:  # a step fake tensors cannot run (a data-dependent shape): no MFU, still trains
                self._flops = None
                print(f"throughput: no throughput/mfu: counting the step's FLOPs on fake tensors failed "
                      f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})", flush=True)
                return
            if self.peak is None:
                self.peak, self.peak_source = peak_flops(self.device, self._dtype, tf32=self._tf32)

    def row(self, *, steps: int, seconds: float, data_wait: float) -> Dict[str, float]:
        """The keys for `steps` steps that took `seconds` of wall time, `data_wait` of it in `next(batches)`."""
        out: Dict[str, float] = {}
        if steps > 0 and seconds > 0:
            step_s = seconds / steps
            if self.tokens_per_step:
                out["throughput/tokens_per_s"] = self.tokens_per_step / step_s
            if self.flops_per_step and self.peak:
                out["throughput/mfu"] = self.flops_per_step / (step_s * self.n_devices * self.peak)
            out.update({"time/step_s": step_s, "time/data_wait_s": data_wait / steps,
                        "time/compute_s": max(seconds - data_wait, 0.0) / steps})
        peak = peak_memory_gib(self.device)
        if peak is not None:
            out["memory/peak_gib"] = peak
        return out
