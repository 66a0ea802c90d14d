"""Which scaled-dot-product-attention kernel a model's attention runs on this device, dtype and shape.

Public names: `sdpa_kernel_name`, `attention_kernel_report`.

torch picks the kernel per call (flash, memory-efficient, cuDNN or math on a GPU; flash or math on
the CPU) from the device, dtype, shapes, mask and the enabled backends, and a compiled step keeps
the kernel picked when it was traced. `sdpa_kernel_name` asks torch itself: it runs the call once
on the device (batch 1) with gradients on and names the kernel from the backward node torch
recorded. `attention_kernel_report` finds the model's first attention call (a forward on meta
tensors) and reports the kernel a deterministic compiled step uses, and the one
`jit(deterministic=False)` would use where they differ.

Example:
    >>> import torch
    >>> q = torch.randn(1, 2, 8, 16)                                   # (B, H, T, D)
    >>> sdpa_kernel_name(q, q, q, is_causal=True)
    'flash (cpu)'
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ...core.jit_backends.determinism import deterministic_algorithms
from ...core.pytree import tree_leaves, tree_map

__all__ = ["attention_kernel_report", "sdpa_kernel_name"]

_KERNELS = (  # a substring of the backward node's name -> the kernel
    ("FlashAttentionForCpu", "flash (cpu)"),
    ("FlashAttention", "flash"),
    ("EfficientAttention", "memory-efficient"),
    ("CudnnAttention", "cudnn"),
)


def sdpa_kernel_name(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor] = None,
                     is_causal: bool = False, deterministic: bool = False) -> str:
    """The kernel `F.scaled_dot_product_attention` picks for these inputs: "flash", "memory-efficient",
    "cudnn", "flash (cpu)" or "math".

    Args:
        q, k, v: (B, H, T, D) on the device and in the dtype of interest (values are not read).
        attn_mask: the boolean or additive mask the call passes, if any.
        is_causal: the call's `is_causal`.
        deterministic: pick as under `jit(deterministic=True)` (strict deterministic algorithms and
            the SDPA backends with deterministic backward passes).
    """
    scope = deterministic_algorithms() if deterministic else contextlib.nullcontext()
    leaves = [torch.zeros(x.shape, dtype=x.dtype, device=x.device, requires_grad=True) for x in (q, k, v)]
    with scope, torch.enable_grad():
        out = F.scaled_dot_product_attention(*leaves, attn_mask=attn_mask, is_causal=is_causal)
    node = out.grad_fn.name() if out.grad_fn is not None else ""
    return next((kernel for part, kernel in _KERNELS if part in node), "math")


class _Found(Exception):
    """Ends the probe forward at the first attention call."""


class _FirstAttentionCall(TorchFunctionMode):
    """Records the arguments of the first `scaled_dot_product_attention` call, then stops the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.call: Optional[dict] = None

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
            self.call = {**dict(zip(names, args)), **kwargs}
            raise _Found()
        return func(*args, **kwargs)


def _on(x: Optional[Tensor], device: torch.device, batch: int = 1) -> Optional[Tensor]:
    if x is None:
        return None
    shape = (min(batch, x.shape[0]), *x.shape[1:]) if x.dim() == 4 else tuple(x.shape)
    return torch.zeros(shape, dtype=x.dtype, device=device) if x.dtype != torch.bool else \
        torch.ones(shape, dtype=torch.bool, device=device)


def attention_kernel_report(model: Any, params: Any, *, seq_len: int, device: torch.device,
                            dtype: Optional[torch.dtype] = None) -> str:
    """One line naming the SDPA kernel the model's attention runs in a compiled step on `device`.

    Args:
        model: an ember model (`apply(params, tokens)` with `tokens` (B, T) int64).
        params: its parameters (only shapes and dtypes are read; DTensors count by their full shape).
        seq_len: the training sequence length T.
        device: the device the step runs on.
        dtype: the compute dtype, if the step casts to one (default: the queries' own dtype).

    Returns:
        e.g. "attention: flash on cuda (bfloat16, H=16, T=2048, D=64); deterministic backward
        (jit(deterministic=False) would pick cudnn)", or "attention: explicit ..." when the model
        computes attention without the fused kernel.
    """
    leaves = [t for t in tree_leaves(params) if isinstance(t, Tensor)]
    plain = all(type(t) is Tensor for t in leaves)
    # Plain parameters: a real forward that stops at the first attention call (embedding and one
    # layer's projections at batch 1). DTensors: a meta forward at their full shapes (no collective).
    run_on = leaves[0].device if plain and leaves else torch.device("meta")
    if not plain:
        params = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                          if isinstance(t, Tensor) else t, params)
    recorder = _FirstAttentionCall()
    try:
        with recorder, torch.no_grad():
            model.apply(params, torch.zeros((1, seq_len), dtype=torch.long, device=run_on))
    except _Found:
        pass
    except Exception as err:  # a model this probe cannot run: say so, never fail the run
        return f"attention: kernel not determined ({type(err).__name__} in a probe forward)"
    call = recorder.call
    if call is None:
        return "attention: explicit (softmax(q k^T) v as matmuls; no fused SDPA kernel)"
    q, k, v = (_on(call[n], device) for n in ("query", "key", "value"))
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    mask, causal = _on(call.get("attn_mask"), device), bool(call.get("is_causal", False))
    shape = f"{str(q.dtype).removeprefix('torch.')}, H={q.shape[1]}, T={q.shape[2]}, D={q.shape[3]}"
    fast = sdpa_kernel_name(q, k, v, attn_mask=mask, is_causal=causal, deterministic=False)
    if device.type == "cpu":  # the CPU's pick (flash or math) does not depend on determinism
        return f"attention: {fast} on cpu ({shape}{', masked' if mask is not None else ''})"
    chosen = sdpa_kernel_name(q, k, v, attn_mask=mask, is_causal=causal, deterministic=True)
    line = f"attention: {chosen} on {device.type} ({shape}{', masked' if mask is not None else ''})"
    line += "; deterministic backward"
    return line + (f" (jit(deterministic=False) would pick {fast})" if fast != chosen else "")
