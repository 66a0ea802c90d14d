"""torch.func levels for a custom `autograd.Function` that recomputes under `torch.func.vjp` (remat).

`torch.utils.checkpoint` does not run under `torch.func.grad` (saved-tensor hooks are unsupported
there), so ember's remat is an `autograd.Function` whose backward must step one functorch level
down and wrap its results back, which needs these private names (WORKAROUNDS entry
`functorch_levels`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch._C import _functorch
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch._functorch.utils import unwrap_dead_wrappers

__all__ = ["current_interpreter", "functorch_base", "own_grad_level", "unwrap_dead_wrappers", "unwrap_for_grad", "wrap_for_grad"]


def current_interpreter() -> Any:
    """The innermost active torch.func transform (its `.lower()` steps one level down)."""
    return retrieve_current_functorch_interpreter()


def unwrap_for_grad(t: Optional[torch.Tensor], level: int) -> Optional[torch.Tensor]:
    return t if t is None else _functorch._unwrap_for_grad(t, level)


def wrap_for_grad(t: Optional[torch.Tensor], level: int) -> Optional[torch.Tensor]:
    return t if t is None else _functorch._wrap_for_grad(t, level)


def own_grad_level(saved: Sequence[Any], grad_outputs: Sequence[Any]) -> Optional[int]:
    """The current functorch grad level if this backward belongs to it, else None.

    True when the innermost transform is `grad`/`vjp` and no saved tensor or incoming gradient
    is a dead wrapper or a wrapper of a deeper level: then the engine is running that level's
    own backward. Not when a `torch.func.vjp` function runs after its level exited (its wrappers
    are dead), nor under a generated vmap rule (the innermost transform is vmap).
    """
    interpreter = _functorch.peek_interpreter_stack()
    if interpreter is None or interpreter.key() != _functorch.TransformType.Grad:
        return None
    level = interpreter.level()
    for t in (*saved, *grad_outputs):
        if t is None or not _functorch.is_gradtrackingtensor(t):
            continue  # plain tensors (a batch captured from outside) need no unwrapping
        if _functorch.is_dead_tensor_wrapper(t) or _functorch.maybe_get_level(t) > level:
            return None
    return level


def functorch_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor under torch.func's wrappers (grad / vmap levels), e.g. for torch_xla to annotate."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t
