"""The GPT-2 family: `model.py` (the math, top to bottom), `config.py` (config and named sizes), `hf.py`.

Public names: `GPT2`, `GPT2Config`, `build_gpt2`, and the layers `CausalSelfAttention`, `MLP`,
`ACTIVATIONS`, `Block`.

Importing this package registers the family `"gpt2"`, its architectures (`tiny`, `small`,
`medium`, `large`, `xl`) and its Hugging Face adapter (`model_type` "gpt2").
"""

from . import hf as hf
from .config import GPT2Config as GPT2Config
from .config import build_gpt2 as build_gpt2
from .model import ACTIVATIONS as ACTIVATIONS
from .model import MLP as MLP
from .model import GPT2 as GPT2
from .model import Block as Block
from .model import CausalSelfAttention as CausalSelfAttention

__all__ = ["ACTIVATIONS", "Block", "CausalSelfAttention", "GPT2", "GPT2Config", "MLP", "build_gpt2"]
