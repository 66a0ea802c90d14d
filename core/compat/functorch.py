"""torch.func levels for a custom `autograd.Function` that recomputes under `torch.func.vjp` (remat).

`torch.utils.checkpoint` does not run under `torch.func.grad` (saved-tensor hooks are unsupported
there), so ember's remat is an `autograd.Function` whose backward must step one functorch level
down and wrap its results back (and `remat_scan` checks which transforms are active), which needs
these private names (WORKAROUNDS entry `functorch_levels`).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
from torch._C import _functorch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters, retrieve_current_functorch_interpreter
from torch._functorch.utils import unwrap_dead_wrappers

__all__ = ["any_transform_active", "backward_one_level_down", "current_interpreter", "functorch_base",
           "only_grad_transforms", "own_grad_level", "unwrap_dead_wrappers", "unwrap_for_grad", "wrap_for_grad"]


def current_interpreter() -> Any:
    """The innermost active torch.func transform (its `.lower()` steps one level down)."""
    return retrieve_current_functorch_interpreter()


def any_transform_active() -> bool:
    """Whether a torch.func transform is active here (an autograd.Function's forward runs below them)."""
    return _functorch.maybe_current_level() is not None


def only_grad_transforms() -> bool:
    """Whether every active torch.func transform is `grad` / `vjp` (no `vmap`, no forward mode)."""
    return all(i.key() == _functorch.TransformType.Grad for i in retrieve_all_functorch_interpreters())


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


def backward_one_level_down(saved: Sequence[Any], grad_outputs: Sequence[Any],
                            compute: Callable[[List[Any], List[Any]], List[Any]]) -> List[Any]:
    """Run a recomputing `autograd.Function.backward` body `compute(saved, grad_outputs)` below the
    grad level that is differentiating it.

    `torch.func.grad` runs its backward with create_graph=True, so every op of the backward would
    also be recorded at the grad's own level and its tensors (the recomputed activations included)
    kept until the whole gradient is done: exactly the memory remat exists to save. Nothing can
    differentiate a level's backward at that same level, so compute one level down (outer levels
    still record, so grad-of-grad stays exact) and wrap the results back. A backward that does not
    belong to the current level (a `torch.func.vjp` function run after its level exited) has its
    dead wrappers unwrapped as the dispatcher would (NOTE [functorch vjp and autograd interaction]).
    """
    level = own_grad_level(saved, grad_outputs)
    if level is None:
        return compute(list(unwrap_dead_wrappers(tuple(saved))), list(unwrap_dead_wrappers(tuple(grad_outputs))))
    with current_interpreter().lower():
        grads = compute([unwrap_for_grad(t, level) for t in saved],
                        [unwrap_for_grad(g, level) for g in grad_outputs])
    return [wrap_for_grad(g, level) for g in grads]
