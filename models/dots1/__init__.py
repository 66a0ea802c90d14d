"""The dots1 family (rednote-hilab's dots.llm1): `model.py`, `config.py` (config and named sizes), `hf.py`.

Public names: `Dots1`, `Dots1Config`, `build_dots1`.

Qwen3's attention with DeepSeek-V3's routing (sigmoid scores, a correction bias, group-limited
top-k, routed scaling, shared experts, leading dense layers): ember's DeepSeek-V3 router style in a
family that transformers can check. Importing this package registers the family `"dots1"`, its
architectures (`tiny`, `142b-a14b`) and its Hugging Face adapter (`model_type` "dots1").
"""

from . import hf as hf
from .config import Dots1Config as Dots1Config
from .config import build_dots1 as build_dots1
from .model import Dots1 as Dots1

__all__ = ["Dots1", "Dots1Config", "build_dots1"]
