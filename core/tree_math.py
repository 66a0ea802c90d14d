"""Arithmetic over pytrees of tensors, vectorised with `torch._foreach_*` (no per-leaf Python math).

Public names: `apply_updates`, `global_norm`, `square_sum`, `tree_add`, `tree_sub`, `tree_scale`,
`tree_zeros_like`, `tree_ones_like`, `tree_cast`, `tree_where`, `tree_all_finite`, `tree_vdot`,
`tree_size`, `tree_bytes`.

All functions are out of place and traceable (`torch.compile(fullgraph=True)`, torch_xla).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from .trace_context import here
from .types import Params, PyTree, Updates

__all__ = [
    "apply_updates",
    "global_norm",
    "square_sum",
    "tree_add",
    "tree_all_finite",
    "tree_bytes",
    "tree_cast",
    "tree_ones_like",
    "tree_scale",
    "tree_size",
    "tree_sub",
    "tree_vdot",
    "tree_where",
    "tree_zeros_like",
]


def _flat2(a: PyTree, b: PyTree):
    la, spec = tree_flatten(a)
    lb, spec_b = tree_flatten(b)
    if spec != spec_b:
        raise ValueError(
            "the two pytrees differ in structure (for example updates that do not match params); "
            f"got\n  {spec}\nand\n  {spec_b}"
        )
    return la, lb, spec


def tree_add(a: PyTree, b: PyTree, alpha: float = 1.0) -> PyTree:
    """`a + alpha * b`, leaf by leaf."""
    la, lb, spec = _flat2(a, b)
    return tree_unflatten(list(torch._foreach_add(la, lb, alpha=alpha)) if la else [], spec)


def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    """`a - b`, leaf by leaf."""
    return tree_add(a, b, alpha=-1.0)


def tree_scale(tree: PyTree, scalar: float | Tensor) -> PyTree:
    """Multiply every leaf by a Python or 0-d tensor scalar."""
    leaves, spec = tree_flatten(tree)
    if not leaves:
        return tree
    return tree_unflatten(list(torch._foreach_mul(leaves, scalar)), spec)


def apply_updates(params: Params, updates: Updates) -> Params:
    """`params + updates`, keeping each parameter's dtype (updates may be fp32 over bf16 params)."""
    lp, lu, spec = _flat2(params, updates)
    if not lp:
        return params
    lu = [u.to(p.dtype) if u.dtype != p.dtype else u for p, u in zip(lp, lu)]
    return tree_unflatten(list(torch._foreach_add(lp, lu)), spec)


def tree_zeros_like(tree: PyTree, dtype: Optional[torch.dtype] = None) -> PyTree:
    """Zeros shaped like every leaf (optionally in `dtype`)."""
    return tree_map(lambda t: torch.zeros_like(t, dtype=dtype), tree)


def tree_ones_like(tree: PyTree, dtype: Optional[torch.dtype] = None) -> PyTree:
    """Ones shaped like every leaf (optionally in `dtype`)."""
    return tree_map(lambda t: torch.ones_like(t, dtype=dtype), tree)


def tree_cast(tree: PyTree, dtype: Optional[torch.dtype]) -> PyTree:
    """Cast floating-point leaves to `dtype` (integer leaves and `dtype=None` are left alone)."""
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def global_norm(tree: PyTree) -> Tensor:
    """The L2 norm of all leaves together, as a 0-d float32 tensor.

    Eagerly (and under Dynamo, which DTensor states take) it is one `torch._foreach_norm`. While
    `jit(backend="inductor")` traces a step it is a sum of squares per leaf instead: Inductor has
    no lowering for `_foreach_norm` and calls one `linalg_vector_norm` per leaf, each its own
    pass over memory that nothing can share. As plain reductions, a train step's two gradient
    norms (its `grad_norm` metric and the clip's) become one reduction per leaf, and its update
    norm is summed inside the kernel that applies the update, so the updates are never stored.
    """
    raw = tree_leaves(tree)
    if not raw:
        return torch.zeros(())
    if here().tracer == "ember":
        return torch.stack([square_sum(t) for t in raw]).sum().sqrt()
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(
        [t if t.dtype == torch.float32 else t.float() for t in raw])))


def square_sum(t: Tensor) -> Tensor:
    """One leaf's term of `global_norm` in a traced step: the sum of its squares, in float32."""
    t = t if t.dtype == torch.float32 else t.float()
    return (t * t).sum()


def tree_vdot(a: PyTree, b: PyTree) -> Tensor:
    """Sum over leaves of `(a * b).sum()` in float32."""
    la, lb, _ = _flat2(a, b)
    return torch.stack([(x.float() * y.float()).sum() for x, y in zip(la, lb)]).sum()


def tree_all_finite(tree: PyTree) -> Tensor:
    """0-d bool tensor: every element of every leaf is finite (one reduction, no host sync)."""
    leaves = tree_leaves(tree)
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    # A non-finite element makes its leaf's sum non-finite; summing the per-leaf sums keeps one
    # fused reduction instead of one `isfinite` kernel per leaf. A sum that overflows float32 also
    # reads as non-finite: gradients that large are unusable anyway.
    sums = torch.stack([t.float().sum() for t in leaves])
    return torch.isfinite(sums.sum())


def tree_where(cond: Tensor, a: PyTree, b: PyTree) -> PyTree:
    """Select whole trees by a 0-d bool tensor, without a host sync: `a if cond else b`."""
    la, lb, spec = _flat2(a, b)
    return tree_unflatten([torch.where(cond, x, y) for x, y in zip(la, lb)], spec)


def tree_size(tree: PyTree) -> int:
    """Total number of elements over all leaves."""
    return sum(t.numel() for t in tree_leaves(tree))


def tree_bytes(tree: PyTree) -> int:
    """Total bytes over all leaves."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree))
