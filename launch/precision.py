"""A run's numerics on its device: the compute dtype, TF32 for float32 matmuls, the whole-step CUDA graph.

Public names: `resolve_compute_dtype`, `set_matmul_precision`, `precision_line`, `check_cuda_graph`.

- `--compute_dtype auto` (the default) is what a GPU user expects: bfloat16 compute on a CUDA GPU that
  supports it (`torch.cuda.is_bf16_supported()`), float32 elsewhere (the CPU, torch_xla), so CPU runs
  are unchanged. Master weights, gradients, the optimizer and the loss (its log-softmax too) stay
  float32 whatever the compute dtype (`ember.core.step_fns.train_step`).
- `--tf32 True` (the default) lets float32 matmuls use TF32 tensor cores on CUDA, through
  `torch.set_float32_matmul_precision("high")`: the one setting that works without a warning on every
  torch from 2.9 to 2.15 (the newer `torch.backends.cuda.matmul.fp32_precision` exists only on newer
  releases, and mixing it with the legacy flags is an error there). The CPU keeps "highest".
- `--cuda_graph True` (opt-in) replays the donated compiled step as one CUDA graph
  (`ember.core.jit(..., cuda_graph=True)`); refused off a CUDA GPU and on a mesh.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ember.core import device_for

__all__ = ["check_cuda_graph", "precision_line", "resolve_compute_dtype", "set_matmul_precision"]


def _bf16_gpu(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_compute_dtype(name: str, device: torch.device) -> Optional[torch.dtype]:
    """The torch dtype `--compute_dtype name` means on `device`: None for float32 (no casting)."""
    if name == "auto":
        return torch.bfloat16 if _bf16_gpu(device) else None
    return None if name == "float32" else getattr(torch, name)


def set_matmul_precision(tf32: bool, device: torch.device) -> Optional[str]:
    """On CUDA, float32 matmuls in TF32 (`tf32`) or full float32; returns torch's setting, None off CUDA."""
    if device.type != "cuda":
        return None  # the CPU's float32 matmuls stay as they are
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return torch.get_float32_matmul_precision()


def precision_line(cfg: Any, device: torch.device) -> str:
    """One line for the start of a run: what computes in which dtype, and the float32 matmuls on CUDA."""
    dtype = resolve_compute_dtype(cfg.compute_dtype, device)
    chosen = f" (--compute_dtype {cfg.compute_dtype})"
    if dtype is None:
        line = f"precision: float32{chosen}"
    else:
        name = str(dtype).replace("torch.", "")
        line = f"precision: {name} compute, float32 master weights, gradients, optimizer and loss{chosen}"
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        line += f"; float32 matmuls {'TF32' if tf32 else 'full float32'} (--tf32 {tf32})"
    if getattr(cfg, "cuda_graph", False):
        line += "; step replayed as a CUDA graph (--cuda_graph True)"
    return line


def check_cuda_graph(cfg: Any, sharding: Any = None) -> None:
    """Refuse `--cuda_graph True` where it cannot run: off Inductor, off a CUDA GPU, on a mesh (ValueError)."""
    if not getattr(cfg, "cuda_graph", False):
        return
    if cfg.backend != "inductor":
        raise ValueError(f"--cuda_graph True captures the Inductor-compiled step, but --backend {cfg.backend} "
                         f"compiles none; pass --backend inductor or --cuda_graph False.")
    device = device_for(cfg.backend)
    if device.type != "cuda":
        raise ValueError(f"--cuda_graph True replays the step as a CUDA graph, but this run is on {device.type} "
                         f"(torch.cuda.is_available() is {torch.cuda.is_available()}); drop --cuda_graph on the CPU.")
    if sharding is not None:
        raise ValueError("--cuda_graph True captures a one-GPU step, but this run is sharded over a mesh "
                         "(DTensor collectives are not captured); drop --cuda_graph or --mesh / torchrun.")
