"""The Qwen2 family (Qwen2, Qwen2.5): `model.py` (what differs from Llama), `config.py` (config and named sizes), `hf.py`.

Public names: `Qwen2`, `Qwen2Config`, `build_qwen2`.

Importing this package registers the family `"qwen2"`, its architectures (`tiny`, `0.5b`, `1.5b`,
`3b`, `7b`, `14b`, `32b`, `72b`: the Qwen2.5 sizes) and its Hugging Face adapter (`model_type` "qwen2").
"""

from . import hf as hf
from .config import Qwen2Config as Qwen2Config
from .config import build_qwen2 as build_qwen2
from .model import Qwen2 as Qwen2

__all__ = ["Qwen2", "Qwen2Config", "build_qwen2"]
