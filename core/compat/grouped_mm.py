"""The grouped GEMM of a mixture of experts' dropless path: `torch._grouped_mm`, where it works.

torch 2.9 names the kernel only privately (`torch.nn.functional.grouped_mm` came later). Its
float32 form runs eagerly on every release, but a trace (fake tensors: `make_fx`, Dynamo) refuses
float32 from 2.9 to 2.14, "Expected inputs of BF16 type" (`WORKAROUNDS["grouped_mm_float32"]`;
pytorch/pytorch#162059 enabled float32 eagerly and left compile support for later). Its strides must
be multiples of 16 bytes on the CPU (pytorch/pytorch#172440), and torch_xla has no lowering of it.
Where it cannot run, `grouped_mm_runs` says so and the caller takes its portable path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import gated_on

__all__ = ["grouped_mm", "grouped_mm_row_alignment", "grouped_mm_runs"]

_KERNEL = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_runs(dtype: torch.dtype, device_type: str, *widths: int) -> bool:
    """Whether `grouped_mm` of `dtype` operands whose rows are `widths` long runs on `device_type`,
    eagerly and traced, on this torch ("meta": shapes only, as a GPU would run it)."""
    if _KERNEL is None or device_type not in ("cpu", "cuda", "meta") or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.float32 and gated_on("grouped_mm_float32"):
        return False
    per_16_bytes = 16 // dtype.itemsize
    return all(w % per_16_bytes == 0 for w in widths)


def grouped_mm_row_alignment(dtype: torch.dtype, device_type: str) -> int:
    """Rows each group is padded to: 16 bytes of `dtype` on CUDA (its kernels' alignment), 1 elsewhere."""
    return 16 // dtype.itemsize if device_type == "cuda" else 1


def grouped_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """Each group of rows of `x` times its own matrix of `w`.

    Args:
        x: (M, K), rows sorted by group.
        w: (G, K, N), group g's matrix.
        ends: (G,) int32, the row after group g's last (non-decreasing; at most M).

    Returns:
        (M, N); the rows from `ends[-1]` on hold no defined value.
    """
    return _KERNEL(x, w, offs=ends)
