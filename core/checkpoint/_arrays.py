"""Torch tensors <-> numpy arrays without copies, for orbax; plus the per-array checksum.

Private module of `ember.core.checkpoint`. orbax (and tensorstore under it) takes numpy arrays,
not torch tensors. A CPU tensor becomes a numpy *view* of the same memory (`Tensor.numpy()`);
dtypes numpy lacks (bfloat16, the float8 family) are viewed as a same-size integer tensor first
and then as the `ml_dtypes` type, which tensorstore writes natively. Restoring is the mirror:
`torch.from_numpy` on the array tensorstore read (zero-copy), viewed back to the torch dtype.

Example:
    >>> import torch
    >>> x = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    >>> a = to_numpy(x)
    >>> a.dtype.name, from_numpy(a, device="cpu").dtype, torch.equal(from_numpy(a, device="cpu"), x)
    ('bfloat16', torch.bfloat16, True)
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

import ml_dtypes
import numpy as np
import torch

__all__ = ["checksums", "dtype_name", "from_numpy", "to_numpy"]

# torch dtypes numpy has no type for: (integer dtype of the same size to view through, ml_dtypes type).
_VIA_ML_DTYPES: Dict[torch.dtype, Any] = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16)}
for _torch_name, _ml_name in [
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("float8_e5m2", "float8_e5m2"),
    ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    ("float8_e5m2fnuz", "float8_e5m2fnuz"),
]:
    if hasattr(torch, _torch_name) and hasattr(ml_dtypes, _ml_name):
        _VIA_ML_DTYPES[getattr(torch, _torch_name)] = (torch.uint8, getattr(ml_dtypes, _ml_name))
_FROM_ML_DTYPES = {np.dtype(ml): (view, t) for t, (view, ml) in _VIA_ML_DTYPES.items()}

_CHECKSUM_THREADS = 4  # zlib.crc32 releases the GIL: threads checksum several arrays at once
_CHECKSUM_CHUNK = 64 << 20  # bytes per crc32 call, so one large array is not one long call


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32 -> "float32"`: the name stored in checkpoint metadata."""
    return str(dtype).removeprefix("torch.")


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """A numpy view of the CPU tensor `x` (same memory; bf16 / float8 through `ml_dtypes`).

    Args:
        x: a CPU tensor (detached or not; the view ignores autograd).

    Returns:
        An array sharing `x`'s memory, with `x`'s shape and a dtype of the same bits.

    Raises:
        TypeError: `x` is not on the CPU, or its dtype has no numpy / ml_dtypes equivalent.
    """
    if x.device.type != "cpu":
        raise TypeError(f"to_numpy needs a CPU tensor, got one on {x.device}; move it with .cpu() first.")
    x = x.detach()
    if x.is_conj():
        x = x.resolve_conj()
    via = _VIA_ML_DTYPES.get(x.dtype)
    if via is not None:
        int_dtype, ml_dtype = via
        return x.view(int_dtype).numpy().view(ml_dtype)
    try:
        return x.numpy()
    except TypeError as e:
        raise TypeError(
            f"a {x.dtype} tensor cannot be checkpointed: numpy has no such dtype and ember maps only "
            f"{sorted(dtype_name(d) for d in _VIA_ML_DTYPES)} through ml_dtypes. Cast it first."
        ) from e


def from_numpy(a: np.ndarray, *, device: Any) -> torch.Tensor:
    """The torch tensor for an array made by `to_numpy` (or read back by orbax), on `device`.

    On the CPU the tensor shares the array's memory when the array is writable and aligned;
    otherwise (and on other devices) the data is copied once.
    """
    a = np.asarray(a)
    via = _FROM_ML_DTYPES.get(a.dtype)
    int_dtype = None
    if via is not None:
        int_dtype, torch_dtype = via
        a = a.view({torch.int16: np.int16, torch.uint8: np.uint8}[int_dtype])
    if not (a.flags.writeable and a.flags.aligned):
        a = a.copy()  # torch.from_numpy warns on read-only arrays
    t = torch.from_numpy(a)
    if int_dtype is not None:
        t = t.view(torch_dtype)
    return t.to(device) if torch.device(device).type != "cpu" else t


def _crc32(a: np.ndarray) -> int:
    buf = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    crc = 0
    for start in range(0, len(buf), _CHECKSUM_CHUNK):
        crc = zlib.crc32(buf[start : start + _CHECKSUM_CHUNK], crc)
    return crc


def checksums(arrays: Sequence[np.ndarray], *, pool: Optional[ThreadPoolExecutor] = None) -> List[int]:
    """CRC-32 of each array's bytes (C order), computed on a few threads.

    orbax stores arrays zstd-compressed without a checksum, so flipped bytes in an array file
    restore silently as different numbers; ember keeps these CRCs in the metadata and compares
    them on restore.
    """
    if pool is None:
        with ThreadPoolExecutor(_CHECKSUM_THREADS, thread_name_prefix="ember-crc") as own:
            return list(own.map(_crc32, arrays))
    return list(pool.map(_crc32, arrays))
