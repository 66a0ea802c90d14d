"""Logical axis names of activations that the model families constrain (parameters name theirs in `Param`).

Public names: `RESIDUAL_AXES`.

Parameter axes used by the built-in layers: `"vocab"`, `"embed"`, `"heads"` (query heads x head_dim,
fused), `"kv_heads"` (key/value heads x head_dim, fused), `"mlp"`, `"layers"` (the leading axis of
`Stacked`), and `None` for dimensions never sharded (learned position tables). The partition-spec
rules (`ember.core.partition_specs.layouts`) map these names onto mesh axes.
"""

__all__ = ["RESIDUAL_AXES"]

RESIDUAL_AXES = ("batch", "sequence", "embed")
"""Logical axes of the residual stream, constrained after each branch (whole under tensor parallelism)."""
