"""The Qwen3-MoE family: `model.py`, `config.py` (config and named sizes), `hf.py`.

Public names: `Qwen3Moe`, `Qwen3MoeConfig`, `build_qwen3_moe`.

Qwen3's attention on the generic MoE decoder (`ember.models.moe_decoder`), softmax top-k routing.
Importing this package registers the family `"qwen3_moe"`, its architectures (`tiny`, `30b-a3b`,
`235b-a22b`) and its Hugging Face adapter (`model_type` "qwen3_moe").
"""

from . import hf as hf
from .config import Qwen3MoeConfig as Qwen3MoeConfig
from .config import build_qwen3_moe as build_qwen3_moe
from .model import Qwen3Moe as Qwen3Moe

__all__ = ["Qwen3Moe", "Qwen3MoeConfig", "build_qwen3_moe"]
