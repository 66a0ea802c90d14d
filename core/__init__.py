"""ember.core: the kernel: pytrees, keys, transforms, jit, TrainState, mesh, protocols, testing helpers.

Public names: `TrainState`, `TrainStateWithFrozen`, `jit`, `Jitted`, `grad`, `value_and_grad`, `vmap`, `remat`, `remat_scan`,
`checkpoint_name`, `scan`, `pipeline`, `context_attention`, `rolled_sum`, `shared_call`, `stack_trees`, `unstack_trees`, `device_for`,
`to_device`, `Mesh`, `MeshError`, and the modules `pytree`, `random`, `tree_math`, `testing`,
`step_fns`, `partition_specs`, `types`.

`core` imports nothing else from ember.
"""

from . import compat as _compat

_compat.check_torch_version()

from . import partition_specs as partition_specs  # noqa: E402
from . import pytree as pytree
from . import random as random
from . import step_fns as step_fns
from . import testing as testing
from . import tree_math as tree_math
from . import types as types
from .device import device_for as device_for
from .device import to_device as to_device
from .jit import Jitted as Jitted
from .jit import jit as jit
from .mesh import Mesh as Mesh
from .mesh import MeshError as MeshError
from .partition_specs.context_parallel import context_attention as context_attention
from .partition_specs.pipeline import pipeline as pipeline
from .train_state import TrainState as TrainState
from .train_state import TrainStateWithFrozen as TrainStateWithFrozen
from .transforms import checkpoint_name as checkpoint_name
from .transforms import grad as grad
from .transforms import remat as remat
from .transforms import remat_scan as remat_scan
from .transforms import rolled_sum as rolled_sum
from .transforms import scan as scan
from .transforms import shared_call as shared_call
from .transforms import stack_trees as stack_trees
from .transforms import unstack_trees as unstack_trees
from .transforms import value_and_grad as value_and_grad
from .transforms import vmap as vmap
from .types import Key as Key
from .types import Metrics as Metrics
from .types import Params as Params
from .types import PyTree as PyTree

__all__ = [
    "Jitted",
    "Key",
    "Mesh",
    "MeshError",
    "Metrics",
    "Params",
    "PyTree",
    "TrainState",
    "TrainStateWithFrozen",
    "checkpoint_name",
    "context_attention",
    "device_for",
    "grad",
    "jit",
    "partition_specs",
    "pipeline",
    "pytree",
    "random",
    "remat",
    "remat_scan",
    "rolled_sum",
    "scan",
    "shared_call",
    "stack_trees",
    "step_fns",
    "testing",
    "to_device",
    "tree_math",
    "types",
    "unstack_trees",
    "value_and_grad",
    "vmap",
]
