"""Model size arithmetic from declared shapes (nothing is allocated).

Public names: `count_params`, `count_active_params`, `estimate_memory`, `MemoryEstimate`, `describe`.

`estimate_memory` is the what-if from a parameter count (an assumed dtype and optimizer-slot count,
gradients included, nothing built). For the bytes one device holds of an actual (or meta) state
under a sharding, with each tensor's own dtype, use `ember.core.partition_specs.memory_per_device`.

Example:
    >>> from ember.models import build_model, count_params, estimate_memory
    >>> model = build_model("llama3", "8b")          # never allocated
    >>> round(count_params(model) / 1e9, 2)
    8.03
    >>> print(estimate_memory(model))                # fp32 params + grads + 2 Adam moments
    params 29.92 GiB + grads 29.92 GiB + optimizer 59.83 GiB = 119.66 GiB
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ..core import pytree

__all__ = ["MemoryEstimate", "count_active_params", "count_params", "describe", "estimate_memory"]

_GIB = 1024**3


def _shape_leaves(model_or_tree: Any) -> list:
    tree = model_or_tree.param_shapes() if hasattr(model_or_tree, "param_shapes") else model_or_tree
    leaves = pytree.tree_leaves(tree)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"count_params expects a model (with param_shapes()) or a pytree of tensors, found a "
                f"{type(leaf).__name__} leaf."
            )
    return leaves


def count_params(model_or_params: Any) -> int:
    """Total number of parameter elements of a model (from its declared shapes) or of a params tree.

    Args:
        model_or_params: an object with `param_shapes()` (any ember model), or a pytree of tensors
            (real or meta).

    Returns:
        The element count (tied weights counted once, as they are one tensor).

    Raises:
        TypeError: a leaf is not a tensor.
    """
    return sum(math.prod(t.shape) for t in _shape_leaves(model_or_params))


def count_active_params(model: Any) -> int:
    """Parameters one token goes through: all but the routed experts it is not sent to (a dense model: all).

    Example:
        >>> from ember.models import build_model
        >>> round(count_active_params(build_model("mixtral", "8x7b")) / 1e9, 1)
        12.9
    """
    total = count_params(model)
    c = model.config
    if not hasattr(c, "n_experts"):
        return total
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    return total - moe_layers * (c.n_experts - c.experts_per_token) * 3 * c.d_model * c.moe_ffn_dim


class MemoryEstimate(NamedTuple):
    """Bytes of training state: parameters, gradients and optimizer slots (activations excluded)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """params + grads + optimizer, in bytes."""
        return self.params + self.grads + self.optimizer

    def __str__(self) -> str:
        g = lambda b: f"{b / _GIB:.2f} GiB"  # noqa: E731
        return (
            f"params {g(self.params)} + grads {g(self.grads)} + optimizer {g(self.optimizer)} "
            f"= {g(self.total)}"
        )


def estimate_memory(model_or_params: Any, *, optimizer_slots: int = 2, dtype_bytes: int = 4) -> MemoryEstimate:
    """Training-state memory: params, one gradient per param, `optimizer_slots` tensors per param.

    Args:
        model_or_params: a model or a pytree of tensors (see `count_params`).
        optimizer_slots: state tensors per parameter (AdamW: 2, SGD with momentum: 1, Lion: 1).
        dtype_bytes: bytes per element of each of these (4 for float32, 2 for bfloat16).

    Returns:
        A `MemoryEstimate` (bytes); activations and temporaries are not included.

    Raises:
        ValueError: negative `optimizer_slots` or non-positive `dtype_bytes`.
    """
    if optimizer_slots < 0:
        raise ValueError(f"optimizer_slots must be >= 0, got {optimizer_slots}.")
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes}.")
    n = count_params(model_or_params)
    return MemoryEstimate(params=n * dtype_bytes, grads=n * dtype_bytes, optimizer=n * dtype_bytes * optimizer_slots)


def describe(model: Any, *, optimizer_slots: int = 2) -> str:
    """A table of every parameter (path, shape, logical axes, size), the total, and the memory estimate.

    Shapes come from `model.param_shapes()` (meta tensors): nothing is allocated, so this works
    for models far larger than the machine (`--dry-run`).

    Example:
        >>> from ember.models import build_model
        >>> print(describe(build_model("gpt2", "tiny")).splitlines()[0])
        parameter                              shape            axes                                    count
    """
    from ..core.pytree import tree_leaves, tree_leaves_with_path  # local: keep import time small

    shapes = tree_leaves_with_path(model.param_shapes())
    axes = tree_leaves(model.axes, is_leaf=lambda x: isinstance(x, tuple))
    rows = [f"{'parameter':<38} {'shape':<16} {'axes':<32} {'count':>12}"]
    for (path, t), ax in zip(shapes, axes):
        rows.append(f"{path:<38} {str(tuple(t.shape)):<16} {str(ax):<32} {t.numel():>12,}")
    n = sum(t.numel() for _, t in shapes)
    rows.append(f"total: {n:,} parameters ({n / 1e6:.2f}M)")
    rows.append(f"training state (fp32, AdamW): {estimate_memory(model, optimizer_slots=optimizer_slots)}")
    return "\n".join(rows)
