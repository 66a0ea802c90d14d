"""What `jit(deterministic=True)` puts in force while ember compiles and runs a step, so repeats give the same bits.

- `torch.use_deterministic_algorithms(True)`, strict (not `warn_only`): only then do the flash and
  memory-efficient attention backward passes take their deterministic algorithms (one key split),
  cuDNN attention (no deterministic backward) is never picked, Inductor falls back to ATen's
  deterministic scatter / `index_put` / `index_add` instead of atomic adds, and an op without a
  deterministic kernel raises instead of warning (ember names it and the fix, `determinism_error`).
- SDPA restricted to the backends with deterministic backward passes (`DETERMINISTIC_SDPA`: flash,
  memory-efficient, math; of those the user left enabled), with `torch.nn.attention.sdpa_kernel`.
- `CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS's deterministic workspaces), set when the first such
  step is built unless the environment already names one; it must be set before cuBLAS starts.
- `torch.utils.deterministic.fill_uninitialized_memory` off: every buffer a step allocates is
  written before it is read, and Inductor's own buffers are never filled, but with it on each
  `torch.empty` an ATen op makes is first filled with NaN (its cost is in BENCHMARKS.md).
The user's own settings (deterministic algorithms and filling, Inductor's deterministic mode, SDPA
backends) are restored after every call. On a GPU the first call logs one notice line (logger "ember").
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Iterator, List, Optional

import torch

from ..compat.inductor_deterministic import kept_inductor_deterministic

__all__ = ["DETERMINISTIC_SDPA", "deterministic_algorithms", "deterministic_sdpa_backends",
           "determinism_error", "ensure_cublas_workspace_config", "notice_once"]

_log = logging.getLogger("ember")

DETERMINISTIC_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
"""SDPA backends whose backward is deterministic under strict deterministic algorithms (torch 2.9-2.15,
aten/src/ATen/native/transformers/cuda/attention_backward.cu); cuDNN's is not."""

CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
"""The `CUBLAS_WORKSPACE_CONFIG` values torch accepts as deterministic."""

_MSG_NOTICE = (
    "ember: jit(deterministic=True) on {device}: compiled steps repeat bit for bit; attention runs "
    "{backends} with deterministic backward passes (cuDNN attention off), cuBLAS with "
    "CUBLAS_WORKSPACE_CONFIG={cublas}; jit(deterministic=False) gives the fastest kernels.")

_MSG_NO_DETERMINISTIC_KERNEL = (
    "jit(deterministic=True): the step calls {op}, which has no deterministic kernel in torch {version} on "
    "{device}, so repeated steps could not give the same bits. Use jit(..., deterministic=False) to run it "
    "anyway (the fast path, not bitwise repeatable), or replace that operation.")

_MSG_CUBLAS = (
    "jit(deterministic=True): cuBLAS needs CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) for deterministic "
    "matmuls, but the environment has {got!r}. Start the process with CUBLAS_WORKSPACE_CONFIG=:4096:8, or use "
    "jit(..., deterministic=False).")

_NO_KERNEL = re.compile(r"^(\S+) does not have a deterministic implementation")


def ensure_cublas_workspace_config() -> str:
    """`CUBLAS_WORKSPACE_CONFIG`, set to `:4096:8` if the environment names none; returns the value in force.

    cuBLAS reads it when it starts (the first matmul on a GPU), so ember sets it when a deterministic
    step is built, before any step runs. A value the user set is left as it is.
    """
    return os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC[0])


def deterministic_sdpa_backends() -> List[object]:
    """The SDPA backends a deterministic step may use: `DETERMINISTIC_SDPA` less those the user disabled."""
    from torch.nn.attention import SDPBackend

    enabled = {"FLASH_ATTENTION": torch.backends.cuda.flash_sdp_enabled(),
               "EFFICIENT_ATTENTION": torch.backends.cuda.mem_efficient_sdp_enabled(),
               "MATH": torch.backends.cuda.math_sdp_enabled()}
    return [getattr(SDPBackend, name) for name in DETERMINISTIC_SDPA if enabled[name]]


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Strict deterministic algorithms and deterministic SDPA backends within the block, then as before."""
    from torch.nn.attention import sdpa_kernel

    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    backends = deterministic_sdpa_backends()
    with contextlib.ExitStack() as stack:
        stack.enter_context(kept_inductor_deterministic())
        if backends:  # none left: the user disabled them all, and SDPA says so itself
            stack.enter_context(sdpa_kernel(backends))
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
            torch.utils.deterministic.fill_uninitialized_memory = fill


def determinism_error(err: BaseException, device: str) -> Optional[RuntimeError]:
    """ember's one-line error for torch's "no deterministic implementation" (or cuBLAS config) error, else None."""
    text = str(err)
    if "CUBLAS_WORKSPACE_CONFIG" in text and "deterministic" in text:
        return RuntimeError(_MSG_CUBLAS.format(got=os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
    found = _NO_KERNEL.search(text.strip())
    if found is None:
        return None
    return RuntimeError(_MSG_NO_DETERMINISTIC_KERNEL.format(op=found.group(1), version=torch.__version__,
                                                            device=device))


_noticed: set = set()


def notice_once(device_type: str) -> Optional[str]:
    """Log `_MSG_NOTICE` once per process for a GPU device type (returns it the first time, else None)."""
    if device_type == "cpu" or device_type in _noticed:
        return None
    _noticed.add(device_type)
    names = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "memory-efficient", "MATH": "math"}
    backends = " / ".join(names[b.name] for b in deterministic_sdpa_backends()) or "no enabled SDPA backend"
    line = _MSG_NOTICE.format(device=device_type, backends=backends,
                              cublas=os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset"))
    _log.warning(line)
    return line
