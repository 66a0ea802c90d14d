"""The Llama-3 family: `model.py` (the math, top to bottom), `config.py` (config and named sizes), `hf.py`.

Public names: `Llama3`, `Llama3Config`, `build_llama3`, and the layers `Attention`, `SwiGLU`, `Block`.

Importing this package registers the family `"llama3"`, its architectures (`tiny`, `125m`, `1b`,
`3b`, `8b`, `3.1-8b`, `70b`) and its Hugging Face adapter (`model_type` "llama").
"""

from . import hf as hf
from .config import Llama3Config as Llama3Config
from .config import build_llama3 as build_llama3
from .model import Attention as Attention
from .model import Block as Block
from .model import Llama3 as Llama3
from .model import SwiGLU as SwiGLU

__all__ = ["Attention", "Block", "Llama3", "Llama3Config", "SwiGLU", "build_llama3"]
