"""The Qwen3 family (dense models): `model.py` (what differs from Llama), `config.py` (config and named sizes), `hf.py`.

Public names: `Qwen3`, `Qwen3Config`, `build_qwen3`.

Importing this package registers the family `"qwen3"`, its architectures (`tiny`, `0.6b`, `1.7b`,
`4b`, `8b`, `14b`, `32b`) and its Hugging Face adapter (`model_type` "qwen3").
"""

from . import hf as hf
from .config import Qwen3Config as Qwen3Config
from .config import build_qwen3 as build_qwen3
from .model import Qwen3 as Qwen3

__all__ = ["Qwen3", "Qwen3Config", "build_qwen3"]
