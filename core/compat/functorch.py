"""Whether a `torch.func` transform is active, and the tensor under its wrappers.

torch has no public query for either (WORKAROUNDS entry `functorch_levels`). ember differentiates
with `torch.autograd.grad`; inside a `torch.func` transform it uses `torch.func` instead, and remat
runs plainly there, because `torch.utils.checkpoint` does not run under `torch.func.grad`
(pytorch#122729) and a recomputing backward under its engine keeps what it recomputes.
"""

from __future__ import annotations

import torch
from torch._C import _functorch

__all__ = ["any_transform_active", "functorch_base", "transform_wrapped"]


def any_transform_active() -> bool:
    """Whether a torch.func transform (`grad`, `vmap`, `jvp`, ...) is active here."""
    return _functorch.maybe_current_level() is not None


def functorch_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor under torch.func's wrappers (grad / vmap levels), e.g. for torch_xla to annotate."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def transform_wrapped(t: torch.Tensor) -> bool:
    """Whether `t` is a tensor of an active torch.func transform's level (made inside a `vmap` or `grad`)."""
    return _functorch.is_functorch_wrapped_tensor(t)
