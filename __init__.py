"""ember: JAX/Flax-style functional training on PyTorch's torch.func.

The small public surface: `jit`, `grad`, `value_and_grad`, `vmap`, `remat`, `scan`, `TrainState`,
`train_step`, `eval_step`, and the modules `random` and `pytree`. The subpackages hold the rest:
`ember.core`, `ember.optim`, `ember.models`, `ember.data`, and the top floor `ember.launch`.
"""

from .core import TrainState as TrainState
from .core import grad as grad
from .core import jit as jit
from .core import pytree as pytree
from .core import random as random
from .core import remat as remat
from .core import scan as scan
from .core import value_and_grad as value_and_grad
from .core import vmap as vmap
from .core.step_fns import eval_step as eval_step
from .core.step_fns import train_step as train_step

from . import _deprecated  # noqa: E402  (old import paths, one more release)

_deprecated.install()

__all__ = [
    "TrainState",
    "eval_step",
    "grad",
    "jit",
    "pytree",
    "random",
    "remat",
    "scan",
    "train_step",
    "value_and_grad",
    "vmap",
]
