"""`count_flops`: the FLOPs of a function, counted by `FlopCounterMode` on fake tensors shaped like its inputs.

Public names: `count_flops`.

Nothing runs for real and no memory is taken: the function runs in a fake mode (`core/compat/inductor.py`)
on fakes of its inputs' global shapes (a DTensor's whole shape, an XLA tensor as a CPU one), and torch's
`FlopCounterMode` counts every matmul, convolution and attention kernel it dispatches, forward and backward.

Example:
    >>> import torch
    >>> count_flops(lambda a, b: a @ b, torch.ones(4, 8), torch.ones(8, 16))  # 2 * 4 * 8 * 16
    1024
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from .compat.inductor import fake_mode
from .pytree import tree_flatten, tree_unflatten

__all__ = ["count_flops"]


def _fake_like(mode: Any, x: Any) -> Any:
    """A fake tensor with `x`'s global shape and dtype (a DTensor's whole shape; XLA tensors as CPU ones)."""
    if not isinstance(x, torch.Tensor):
        return x
    device = x.device if x.device.type in ("cpu", "cuda", "meta") else torch.device("cpu")
    if type(x) is torch.Tensor or isinstance(x, torch.nn.Parameter):
        if x.device == device:
            return mode.from_tensor(x)
    with mode:
        return torch.empty(tuple(x.shape), dtype=x.dtype, device=device)


def count_flops(fn: Callable[..., Any], *args: Any) -> int:
    """FLOPs of `fn(*args)` counted by `FlopCounterMode` on fake tensors shaped like `args` (nothing runs for real).

    Args:
        fn: a pure function of tensors (a training step, a loss).
        *args: pytrees of tensors (real, DTensor or XLA: only shapes and dtypes are read).

    Returns:
        The total FLOPs (a multiply-add counts 2) of the ops `FlopCounterMode` knows (matmuls, convolutions,
        attention kernels, forward and backward).
    """
    leaves, spec = tree_flatten(args)
    mode = fake_mode(shape_env=False)  # static shapes; constants the step closes over (tables, buffers) stay real
    fakes = tree_unflatten([_fake_like(mode, x) for x in leaves], spec)
    counter = FlopCounterMode(display=False)
    with mode, counter:
        fn(*fakes)
    return int(counter.get_total_flops())
