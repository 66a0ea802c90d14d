"""Child-process measurement for `launch/bench_scale.py --torch-primitives`: torch's own checkpointing
against ember's remat and `remat_scan`, inside ember's compiled step.

Public names: `PRIMITIVES`, `primitives_child`.

A stack of residual MLP blocks, stacked weights, gradient taken by `ember.core.transforms.value_and_grad`
inside `jit(backend="inductor")`. Variants are `<loop>-<remat>`:
- loop `unrolled` (a Python loop) or `ember_scan` (`ember.core.transforms.remat_scan`, one
  `scan` node each way);
- remat `none`, `ember` (`ember.core.transforms.remat`, policy full), `ember_dots` (dots_saveable),
  `checkpoint` (`torch.utils.checkpoint`, non-reentrant) or `sac_dots` (the same with a selective
  policy keeping matmul outputs).
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any, Callable, Dict

import torch

from ember.core import jit
from ember.core.transforms import remat, remat_scan, value_and_grad

from .children import memory_peak

PRIMITIVES = ("unrolled-none", "unrolled-ember", "unrolled-checkpoint", "unrolled-ember_dots", "unrolled-sac_dots",
              "ember_scan-none", "ember_scan-ember")


def _block(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x + torch.nn.functional.gelu(x @ w1) @ w2


def _rematted(how: str) -> Callable[..., torch.Tensor]:
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return (CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return {
        "none": _block,
        "ember": remat(_block),
        "ember_dots": remat(_block, policy="dots_saveable"),
        "checkpoint": lambda *a: checkpoint(_block, *a, use_reentrant=False),
        "sac_dots": lambda *a: checkpoint(_block, *a, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, keep_matmuls)),
    }[how]


def _loss(variant: str, layers: int) -> Callable[..., torch.Tensor]:
    loop, how = variant.split("-")
    block = _rematted(how)

    def loss(p: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if loop == "ember_scan":
            x = remat_scan(lambda h, w, _: _block(w[0], w[1], h), x, (p["w1"], p["w2"]),
                           policy="full" if how == "ember" else "none")
        else:
            for i in range(layers):
                x = block(p["w1"][i], p["w2"][i], x)
        return x.square().mean()

    return loss


def primitives_child(variant: str, *, layers: int = 8, width: int = 256, hidden: int = 1024,
                     batch: int = 4096) -> Dict[str, Any]:
    """Cold first call, warm step seconds, transient memory at peak of the compiled value-and-grad, and
    the largest gradient difference from the unrolled plain loop computed eagerly."""
    g = torch.Generator().manual_seed(0)
    p = {"w1": torch.randn(layers, width, hidden, generator=g) / width**0.5,
         "w2": torch.randn(layers, hidden, width, generator=g) / hidden**0.5}
    x = torch.randn(batch, width, generator=g)
    _, want = value_and_grad(_loss("unrolled-none", layers))(p, x)
    step = jit(value_and_grad(_loss(variant, layers)))
    start = time.perf_counter()
    value, grads = step(p, x)
    first = time.perf_counter() - start
    start = time.perf_counter()
    step(p, x)
    warm = time.perf_counter() - start
    error = max(float((grads[k] - want[k]).abs().max()) for k in want)
    del value, grads
    gc.collect()
    base, peak = memory_peak(lambda: step(p, x), cuda=False)
    return {"first_call_s": first, "step_s": warm, "transient_bytes": peak - base, "grad_error": error}
