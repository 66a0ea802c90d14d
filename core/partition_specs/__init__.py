"""ember.core.partition_specs: logical-axis rules -> `PartitionSpec` -> DTensor or torch_xla SPMD.

Public names: `PartitionSpec`, `Rules`, `ShardingRuleError`, `resolve`, `resolve_tree`, `Layout`,
`ACTIVATION_RULES`, `MESH_ORDER`, `data_parallel`, `fsdp`, `tensor_parallel`, `fsdp_tp`, `for_mesh`, `Sharding`,
`Lowering`, `shard`, `shard_batch`, `constrain`, `use_sharding`, `current_sharding`,
`specs_like_params`, `describe_sharding`, `sharding_table`, `ShardRow`, `memory_per_device`,
`MemoryPerDevice`, `local_shape_of`, `axes_from_rules` (path-pattern rules for bridged modules),
`explicit_attention_required` (when a sharding forces explicit attention), `on_whole_axes` and
`WholeAxesPlacement` (a function that needs some axes whole, placed on a mesh: Muon's Newton-Schulz).

The pieces, in order: a model names each parameter's dimensions (`model.axes`, logical names such
as `("mlp", "embed")`); ordered rules map logical names to mesh axes (`rules.py`, Flax semantics,
loud errors); a `Layout` holds two rule sets, where parameters live and how compute sees them
(`layouts.py`: data parallel, FSDP, Megatron TP, FSDP x TP); a `Sharding` binds a layout to a
`Mesh` (`ember.core.mesh`) and to one of two lowerings of the same spec, DTensor (`dtensor.py`)
or torch_xla SPMD (`xla.py`), imported only when used.

Example:
    >>> from ember.core.partition_specs import Rules, resolve
    >>> resolve(("vocab", "embed"), Rules([("vocab", "tp"), ("embed", "fsdp")]))
    PartitionSpec('tp', 'fsdp')
"""

from .attention_policy import explicit_attention_required as explicit_attention_required
from .layouts import ACTIVATION_RULES as ACTIVATION_RULES
from .layouts import MESH_ORDER as MESH_ORDER
from .layouts import Layout as Layout
from .layouts import data_parallel as data_parallel
from .layouts import for_mesh as for_mesh
from .layouts import fsdp as fsdp
from .layouts import fsdp_tp as fsdp_tp
from .layouts import tensor_parallel as tensor_parallel
from .path_rules import axes_from_rules as axes_from_rules
from .report import MemoryPerDevice as MemoryPerDevice
from .report import ShardRow as ShardRow
from .report import describe_sharding as describe_sharding
from .report import local_shape_of as local_shape_of
from .report import memory_per_device as memory_per_device
from .report import sharding_table as sharding_table
from .rules import Rules as Rules
from .rules import ShardingRuleError as ShardingRuleError
from .rules import resolve as resolve
from .rules import resolve_tree as resolve_tree
from .sharding import Lowering as Lowering
from .sharding import Sharding as Sharding
from .sharding import constrain as constrain
from .sharding import current_sharding as current_sharding
from .sharding import shard as shard
from .sharding import shard_batch as shard_batch
from .sharding import specs_like_params as specs_like_params
from .sharding import use_sharding as use_sharding
from .spec import PartitionSpec as PartitionSpec
from .whole_axes import WholeAxesPlacement as WholeAxesPlacement
from .whole_axes import on_whole_axes as on_whole_axes

__all__ = [
    "ACTIVATION_RULES",
    "Layout",
    "Lowering",
    "MESH_ORDER",
    "MemoryPerDevice",
    "PartitionSpec",
    "Rules",
    "ShardRow",
    "Sharding",
    "ShardingRuleError",
    "WholeAxesPlacement",
    "axes_from_rules",
    "constrain",
    "current_sharding",
    "data_parallel",
    "describe_sharding",
    "explicit_attention_required",
    "for_mesh",
    "fsdp",
    "fsdp_tp",
    "local_shape_of",
    "memory_per_device",
    "on_whole_axes",
    "resolve",
    "resolve_tree",
    "shard",
    "shard_batch",
    "sharding_table",
    "specs_like_params",
    "tensor_parallel",
    "use_sharding",
]
