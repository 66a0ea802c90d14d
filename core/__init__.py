"""ember.core: pytrees, keys, transforms, jit, TrainState and testing helpers.

`core` imports nothing else from ember.
"""

from . import pytree as pytree
from . import random as random
from . import tree_math as tree_math
from .train_state import TrainState as TrainState
from .types import Key as Key
from .types import Metrics as Metrics
from .types import Params as Params
from .types import PyTree as PyTree

__all__ = [
    "Key",
    "Metrics",
    "Params",
    "PyTree",
    "TrainState",
    "pytree",
    "random",
    "tree_math",
]
