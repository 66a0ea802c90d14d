"""`Layout`: where parameters live and how compute sees them (two rule sets), and ready-made layouts.

Public names: `Layout`, `ACTIVATION_RULES`, `data_parallel`, `fsdp`, `tensor_parallel`, `fsdp_tp`,
`for_mesh`.

As in Levanter, a layout is two mappings over the same logical axes:

* `params`: how parameters (and, by structure, optimizer state) are stored between steps;
* `compute`: how a layer sees its parameters while it runs, plus the activation rules (batch,
  sequence, heads, ...), applied by `constrain`.

FSDP (ZeRO-3) is then a rule choice, not a code path: store `embed` split over `fsdp`, compute
with it whole, and each layer all-gathers its weights when it runs (their gradients are
reduce-scattered back). Megatron tensor parallelism is the same rules in both mappings: column
parallel in (`heads`, `kv_heads`, `mlp`, `vocab` split over `tp` on the output dimension), row
parallel out (`wo`, `down` split over `tp` on the input dimension).

The ready-made layouts name the mesh axes `dp` (data parallel: batch only), `fsdp` (batch and
parameter storage), `tp` (tensor parallel), `ep` (expert parallel: the stacked experts of a
mixture of experts, and a batch axis everywhere else, as MaxText's expert axis), `pp` (pipeline
stages: the stacked layers) and `cp` (context parallel: the sequence of every activation, the
parameters whole, gradients all-reduced over it as over a batch axis); `for_mesh` keeps
only the axes a mesh has, so `--mesh dp=2`, `--mesh fsdp=2,tp=2` and `--mesh ep=2,fsdp=2` all use
`fsdp_tp()`. A MoE layer's dispatch buffer is `("batch", ...)` as tokens arrive and
`("batch_no_expert", "expert", ...)` while the experts run: from one to the other is an all-to-all.

Example:
    >>> from ember.core.partition_specs import resolve
    >>> lay = fsdp_tp()
    >>> resolve(("mlp", "embed"), lay.params), resolve(("mlp", "embed"), lay.compute)
    (PartitionSpec('tp', 'fsdp'), PartitionSpec('tp', None))
    >>> resolve(("batch", "sequence", "embed"), lay.compute)
    PartitionSpec(('dp', 'fsdp', 'ep'), 'cp', None)
    >>> resolve(("expert", "mlp", "embed"), lay.params)     # stacked experts: split over ep
    PartitionSpec('ep', 'tp', 'fsdp')
    >>> resolve(("mlp", "embed"), fsdp_tp().restrict_to(("dp",)).params)   # dp only: replicated
    PartitionSpec(None, None)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .rules import Rules, ShardingRuleError

__all__ = ["ACTIVATION_RULES", "Layout", "MESH_ORDER", "data_parallel", "for_mesh", "fsdp", "fsdp_tp",
           "tensor_parallel"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Two rule sets over the same logical axes: `params` (storage) and `compute` (use + activations)."""

    params: Rules
    compute: Rules
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", Rules(self.params))
        object.__setattr__(self, "compute", Rules(self.compute))

    @classmethod
    def same(cls, rules: Sequence, name: str = "custom") -> "Layout":
        """A layout whose parameters are stored exactly as compute uses them."""
        return cls(Rules(rules), Rules(rules), name)

    def mesh_axes(self) -> tuple:
        """Every mesh axis either rule set names."""
        return tuple(dict.fromkeys(self.params.mesh_axes() + self.compute.mesh_axes()))

    def restrict_to(self, mesh_names: Sequence[str]) -> "Layout":
        """The layout with mesh axes missing from `mesh_names` removed from both rule sets."""
        return Layout(self.params.restrict_to(mesh_names), self.compute.restrict_to(mesh_names), self.name)


# Activations: a batch is split over every data-like axis, the sequence over cp (context parallelism);
# heads, MLP features and vocabulary logits follow the tensor-parallel weights; the residual stream
# (embed) stays whole.
ACTIVATION_RULES = Rules([
    ("batch", ("dp", "fsdp", "ep")),
    ("batch_no_expert", ("dp", "fsdp")),
    ("expert", "ep"),
    ("sequence", "cp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("vocab", "tp"),
    ("embed", None),
    ("head_dim", None),
    ("layers", "pp"),
])

MESH_ORDER = ("pp", "dp", "fsdp", "cp", "ep", "tp")
"""The order of the ready-made layout's mesh axes, major first (`Mesh.in_order`): pipeline stages
outermost (their exchange is the smallest), then a batch split over
`(dp, fsdp, ep)` then leaves each `ep` group one block of `(dp, fsdp)`'s share, so the MoE token
exchange is an all-to-all within `ep`; `cp` (the sequence's all-gathers, once per layer) sits inside the
batch axes and outside `tp` (its all-reduces, twice per layer), as in torchtitan."""

_TP_WEIGHTS = [("layers", "pp"), ("expert", "ep"), ("vocab", "tp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp")]
_WHOLE = [("layers", None), ("expert", None), ("vocab", None), ("heads", None), ("kv_heads", None), ("mlp", None),
          ("embed", None)]


def data_parallel(axis: str = "dp") -> Layout:
    """Replicated parameters, batch split over `axis` (gradients all-reduced)."""
    return Layout(Rules(_WHOLE), Rules([("batch", axis), ("batch_no_expert", axis)]) + _WHOLE, "data_parallel")


def fsdp(axis: str = "fsdp") -> Layout:
    """ZeRO-3: parameters stored split over `axis` on `embed`, gathered per layer; batch split over `axis`."""
    return Layout(Rules([("embed", axis)]) + _WHOLE, Rules([("batch", axis), ("batch_no_expert", axis)]) + _WHOLE,
                  "fsdp")


def tensor_parallel(axis: str = "tp") -> Layout:
    """Megatron: column-parallel in (heads, kv_heads, mlp, vocab), row-parallel out; batch replicated."""
    rules = Rules([(n, axis if m == "tp" else m) for n, m in _TP_WEIGHTS]) + [("embed", None)]
    acts = Rules([("batch", None), ("batch_no_expert", None), ("expert", None)]
                 + [(n, axis if m == "tp" else None) for n, m in ACTIVATION_RULES
                    if not n.startswith(("batch", "expert"))])
    return Layout(rules, acts, "tensor_parallel")


def fsdp_tp() -> Layout:
    """The general layout over mesh axes `dp`, `fsdp`, `tp`, `ep`, `pp` (stacked layers split by stage), `cp`
    (activations split along the sequence); `restrict_to` / `for_mesh` for fewer."""
    return Layout(Rules(_TP_WEIGHTS) + [("embed", "fsdp")] + _WHOLE, ACTIVATION_RULES, "fsdp_tp")


def for_mesh(mesh_names: Sequence[str]) -> Layout:
    """`fsdp_tp()` restricted to the axes of a mesh whose axes are among `dp`, `fsdp`, `tp`, `ep`, `pp`, `cp`.

    Raises:
        ShardingRuleError: the mesh has an axis the ready-made layout does not use (name your own rules).
    """
    names = tuple(getattr(mesh_names, "names", mesh_names))
    unknown = [n for n in names if n not in MESH_ORDER]
    if unknown:
        raise ShardingRuleError(
            f"mesh axis {unknown[0]!r} is not used by the ready-made layout (axes {', '.join(MESH_ORDER)}); rename it, or "
            f"pass your own rules, e.g. Layout.same([('batch', {unknown[0]!r}), ...])."
        )
    return fsdp_tp().restrict_to(names)
