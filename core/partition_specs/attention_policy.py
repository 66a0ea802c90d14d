"""When the active sharding forces attention to be computed explicitly rather than by the fused kernel.

Public names: `explicit_attention_required`.

Under DTensor sharding (an active `use_sharding` with the dtensor backend) the fused
`scaled_dot_product_attention` kernel runs on each shard (heads split under tensor parallelism, the
batch under data parallelism; ember adds the CPU kernel's sharding rule in `ember.core.compat`).
DTensor cannot place a mask given to the fused kernel, so a masked call (segment ids, padding, a
window) runs the kernel on each process's local tensors (`ember.models.layers.attention`). Where the
DTensors are not seen (inside a `torch.func` transform, whose wrappers `isinstance` does not see
through) and for attention dropout, `softmax(q k^T) v` is computed explicitly; its matmuls flatten
(B, H) into one dimension, which DTensor allows only while the heads are whole, so there a split of
the heads raises. Models ask `explicit_attention_required` and stay free of backend checks; torch_xla
and unsharded runs always get False.

Example:
    >>> explicit_attention_required(dropout=False, masked=True)  # no active sharding
    False
"""

from __future__ import annotations

from typing import Optional, Tuple

from .sharding import current_sharding

__all__ = ["explicit_attention_required"]

_ATTENTION_AXES = ("batch", "heads", "sequence", "head_dim")
"""Logical axes of queries, keys and values as attention sees them: (B, H, T, D)."""

_MSG_SPLIT_HEADS = (
    "Attention: {what} under DTensor sharding needs the heads dimension whole, but the active layout "
    "splits 'heads' over mesh axes {axes}. The explicit attention this takes reshapes (B, H, T, T) to "
    "(B*H, T, T), which DTensor cannot do with H split. Train without {what} under tensor parallelism, or "
    "use a layout that keeps heads whole (e.g. --mesh fsdp=N or dp=N)."
)


def _dtensor_heads_split() -> Optional[Tuple[str, ...]]:
    """Under an active DTensor sharding: the mesh axes the heads are split over (() if whole); else None.

    The active sharding is the signal, not `isinstance(q, DTensor)`: under `torch.func.grad` the
    queries are functorch wrappers around DTensors, which `isinstance` does not see through.
    """
    sharding = current_sharding()
    if sharding is None or sharding.mesh.backend != "dtensor":
        return None
    return sharding.compute_spec(_ATTENTION_AXES).mesh_axes_of(1)


def explicit_attention_required(*, dropout: bool, masked: bool) -> bool:
    """True when the active sharding needs explicit attention for this call (DTensor with a mask or dropout).

    Args:
        dropout: the call applies attention-probability dropout (already an explicit computation).
        masked: the call has a mask beyond plain causal (segment ids or padding).

    Returns:
        False without an active DTensor sharding, or when the call has neither mask nor dropout.

    Raises:
        NotImplementedError: the call needs explicit attention but the layout splits the heads.
    """
    split = _dtensor_heads_split()
    if split is None or not (dropout or masked):
        return False
    if split:
        what = "attention dropout" if dropout else "an attention mask (segment_ids / attention_mask)"
        raise NotImplementedError(_MSG_SPLIT_HEADS.format(what=what, axes=split))
    return True
