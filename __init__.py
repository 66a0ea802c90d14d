"""ember: JAX/Flax-style functional training on PyTorch's torch.func."""

from .core import TrainState as TrainState
from .core import pytree as pytree
from .core import random as random

__all__ = ["TrainState", "pytree", "random"]
