"""The backends behind `ember.jit`: eager, Inductor (traced or Dynamo), torch_xla; donation.

Each backend object is called as `backend(args, kwargs) -> (out, ok)` (`ok` False: the output could
not be donated) and counts its own compiled graphs in `compile_count`.
"""

from .eager import EagerBackend
from .inductor import InductorBackend
from .xla import XlaBackend

__all__ = ["EagerBackend", "InductorBackend", "XlaBackend"]
