"""Private helpers for math over flat leaf lists with `torch._foreach_*` (out of place: in place only on lists
they made themselves).

Every scalar argument may be a Python number or a 0-d tensor (a hyperparameter injected by
`inject_hyperparams`); the `torch._foreach_*` overloads taking a single tensor broadcast a 0-d
float32 tensor over every leaf without promoting low-precision leaves (bf16 stays bf16).
"""

from __future__ import annotations

import numbers
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..core.pytree import tree_leaves
from ..core.types import PyTree
from .base import Scalar

Leaves = List[Tensor]


def device_of(tree: PyTree) -> torch.device:
    """The device of the first leaf (CPU for a tree without leaves)."""
    leaves = tree_leaves(tree)
    return leaves[0].device if leaves else torch.device("cpu")


def zero_count(tree: PyTree) -> Tensor:
    """A 0-d int64 zero on the device of `tree`'s leaves: the step count of a fresh state."""
    return torch.zeros((), dtype=torch.int64, device=device_of(tree))


def is_number(x: object) -> bool:
    """True for Python / numpy real numbers (not bools, not tensors)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def mul(xs: Sequence[Tensor], s: Scalar) -> Leaves:
    """`s * x` for every leaf."""
    return list(torch._foreach_mul(xs, s)) if xs else []


def is_dtensor(x: Tensor) -> bool:
    """True for a `torch.distributed.tensor.DTensor` (without importing torch.distributed)."""
    return type(x).__name__ == "DTensor" and type(x).__module__.startswith("torch.distributed")


def add_scalar(xs: Sequence[Tensor], s: Scalar) -> Leaves:
    """`x + s` for every leaf.

    `torch._foreach_add(xs, tensor)` resolves to the Scalar overload and calls `.item()` (a host
    sync, and a graph break under `torch.compile`), so a tensor `s` goes to the `.Tensor` overload
    explicitly (one fused kernel on CUDA). DTensor has no sharding rule for that overload: for
    DTensors the `.List` overload takes `s` repeated.
    """
    if not xs:
        return []
    if not isinstance(s, Tensor):
        return list(torch._foreach_add(xs, s))
    if is_dtensor(xs[0]):
        return list(torch._foreach_add(xs, [s] * len(xs)))
    return list(torch.ops.aten._foreach_add.Tensor(list(xs), s))


def sign(xs: Sequence[Tensor]) -> Leaves:
    """`sign(x)` for every leaf (per leaf for DTensors: DTensor has no `_foreach_sign` rule)."""
    if not xs:
        return []
    if is_dtensor(xs[0]):
        return [torch.sign(x) for x in xs]
    return list(torch._foreach_sign(xs))


def add_scaled(xs: Sequence[Tensor], ys: Sequence[Tensor], alpha: Scalar) -> Leaves:
    """`x + alpha * y` for every pair of leaves."""
    if not xs:
        return []
    if isinstance(alpha, Tensor):
        return list(torch._foreach_add(xs, torch._foreach_mul(ys, alpha)))
    return list(torch._foreach_add(xs, ys, alpha=alpha))


def moment(gs: Sequence[Tensor], ms: Sequence[Tensor], decay: Scalar) -> Leaves:
    """The exponential moving average `(1 - decay) * g + decay * m` (optax's operation order), summed in
    place into the first product where the dtypes agree (a wider moment, `mu_dtype`, keeps its precision)."""
    if not gs:
        return []
    new, old = torch._foreach_mul(gs, 1 - decay), torch._foreach_mul(ms, decay)
    if any(g.dtype != m.dtype for g, m in zip(gs, ms)):
        return list(torch._foreach_add(new, old))
    torch._foreach_add_(new, old)
    return list(new)


def adam_direction(mu: Sequence[Tensor], nu: Sequence[Tensor], corrections: Tuple[Optional[Tensor], Tensor],
                   eps: Scalar, eps_root: Scalar = 0.0) -> Leaves:
    """Adam's `(mu / c1) / (sqrt(nu / c2 + eps_root) + eps)` for every leaf, `corrections = (c1, c2)`; `c1` None for
    a first moment already corrected (Nesterov's look-ahead).

    Without `eps_root` computed as `mu / (sqrt(nu) / sqrt(c2) + eps) / c1`: two new lists, the rest in place on
    them (a DTensor, or an `eps_root`, takes a new list per operation).
    """
    if not mu:
        return []
    c1, c2 = corrections
    no_root = is_number(eps_root) and eps_root == 0.0
    if is_dtensor(mu[0]) or not no_root:
        nu_hat = torch._foreach_div(nu, c2)
        denom = add_scalar(torch._foreach_sqrt(nu_hat if no_root else add_scalar(nu_hat, eps_root)), eps)
        return list(torch._foreach_div(mu if c1 is None else torch._foreach_div(mu, c1), denom))
    denom = torch._foreach_sqrt(nu)
    torch._foreach_div_(denom, torch.sqrt(c2))
    if isinstance(eps, Tensor):
        torch.ops.aten._foreach_add_.Tensor(denom, eps)  # the Scalar overload would call `.item()`
    else:
        torch._foreach_add_(denom, eps)
    out = torch._foreach_div(mu, denom)
    if c1 is not None:
        torch._foreach_div_(out, c1)
    return list(out)


def cast(xs: Sequence[Tensor], dtypes: Union[torch.dtype, Sequence[torch.dtype], None]) -> Leaves:
    """Cast each leaf to `dtypes` (one dtype for all, or one per leaf); `None` keeps the leaves."""
    if dtypes is None:
        return list(xs)
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(xs)
    return [x if x.dtype == d else x.to(d) for x, d in zip(xs, dtypes)]


def dtypes_of(xs: Sequence[Tensor]) -> List[torch.dtype]:
    """The dtype of each leaf."""
    return [x.dtype for x in xs]


def bias_correction(decay: Scalar, count: Tensor) -> Tensor:
    """`1 - decay ** count` as a 0-d float32 tensor (float32 whatever the leaves' dtype)."""
    return 1 - torch.pow(decay, count.to(torch.float32))


def look_ahead(mu: Sequence[Tensor], gs: Sequence[Tensor], decay: Scalar, count: Tensor) -> Leaves:
    """Nesterov's bias-corrected look-ahead moment, optax's: `decay * mu / (1 - decay^(count + 1)) + (1 - decay) * g /
    (1 - decay^count)`."""
    ahead = torch._foreach_mul(mu, decay / bias_correction(decay, count + 1))
    torch._foreach_add_(ahead, torch._foreach_mul(gs, (1 - decay) / bias_correction(decay, count)))
    return list(ahead)


def per_leaf_rms(xs: Sequence[Tensor]) -> Leaves:
    """The root mean square of each leaf, as a list of 0-d float32 tensors."""
    if not xs:
        return []
    norms = torch._foreach_norm([x if x.dtype == torch.float32 else x.float() for x in xs])
    return list(torch._foreach_div(norms, [float(max(x.numel(), 1)) ** 0.5 for x in xs]))


def scalar_map(fn: Callable[[Tensor], Tensor], scalars: Sequence[Tensor]) -> Leaves:
    """Apply an elementwise `fn` to per-leaf 0-d tensors.

    Plain tensors go through one stacked vector (two kernels however many leaves, then views);
    DTensors leaf by leaf, since DTensor's sharding rules for stacked 0-d tensors are incomplete.
    """
    if not scalars:
        return []
    if is_dtensor(scalars[0]):
        return [fn(s) for s in scalars]
    out = fn(torch.stack(list(scalars)))
    return [out[i] for i in range(len(scalars))]
