"""Stage env: versions, the GPU, every native extension the launchers load (in one process), the matmul peak.

    python -m ember.launch.device_check.env_probe [--peak-reps N]

A clash between the C++ libraries that torch, jax, tensorstore and array_record bundle crashes
here, with faulthandler's stack, instead of somewhere inside a run. On a GPU it also measures how
much GPU memory starting JAX takes (orbax starts JAX at its first checkpoint).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import sys
import time
from typing import Any, Dict

import torch

from ember.core import device_for

from .common import emit

PACKAGES = ("triton", "numpy", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "orbax-checkpoint",
            "tensorstore", "grain", "array-record", "portpicker", "tyro", "docstring-parser", "typeguard",
            "beartype", "protobuf", "etils", "ml-dtypes", "safetensors", "tokenizers", "transformers", "optax")
NATIVE_IMPORTS = ("grain", "array_record.python.array_record_module", "tensorstore", "jax", "orbax.checkpoint",
                  "tyro", "ember", "ember.data", "ember.launch", "ember.launch.benchmark")


def _gpu_info() -> Dict[str, Any]:
    p, b = torch.cuda.get_device_properties(0), torch.backends.cuda
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
            "sms": p.multi_processor_count, "sdpa": {"flash": b.flash_sdp_enabled(), "cudnn": b.cudnn_sdp_enabled(),
                                                     "mem_efficient": b.mem_efficient_sdp_enabled()},
            "tf32_matmul": b.matmul.allow_tf32, "float32_matmul_precision": torch.get_float32_matmul_precision()}


def _imports() -> Dict[str, str]:
    out = {}
    for name in NATIVE_IMPORTS:
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
            out[name] = f"ok {time.perf_counter() - t0:.1f}s"
        except Exception as e:  # noqa: BLE001 - the probe reports every failure and goes on
            out[name] = f"FAILED {type(e).__name__}: {e}"[:300]
    return out


def _jax_gpu_grab() -> Dict[str, Any]:
    """GPU memory that starting JAX's backends takes (XLA preallocates 75% by default)."""
    free_before = torch.cuda.mem_get_info()[0]
    import jax

    devices = jax.devices()  # starts the backends, as orbax's first process_index() does
    return {"backend": jax.default_backend(), "devices": [str(d) for d in devices],
            "took_gib": round((free_before - torch.cuda.mem_get_info()[0]) / 2**30, 1),
            "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peak-reps", type=int, default=10, help="matmul tries; the best one is the peak")
    args = p.parse_args(argv)
    device = device_for("inductor")
    res: Dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                           "device": str(device)}
    if device.type == "cuda":
        res["gpu"] = _gpu_info()
    versions = {}
    for dist in PACKAGES:
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    res["packages"] = versions
    res["imports"] = _imports()
    from ember.core import compat
    from ember.launch.benchmark import matmul_peak

    res["torch_line"] = compat.torch_minor()
    res["ci_tested_torch"] = list(compat.TESTED_TORCH)
    res["patches_on"] = [n for n, w in compat.WORKAROUNDS.items() if w.kind == "patch" and compat.gated_on(n)]
    peak = matmul_peak(device, reps=args.peak_reps)
    res["peak_tflops"], res["peak_matmul"] = peak["flops"] / 1e12, peak["matmul"]
    if device.type == "cuda":
        res["jax_start"] = _jax_gpu_grab()
    failed = [k for k, v in res["imports"].items() if not v.startswith("ok")]
    if failed:
        res["error"] = f"imports failed: {', '.join(failed)}"
    emit("env", res)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
