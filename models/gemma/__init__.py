"""The Gemma family (Gemma 1): `model.py` (what differs from Llama), `config.py` (config and named sizes), `hf.py`.

Public names: `Gemma`, `GemmaConfig`, `build_gemma`, and the layers `GemmaRMSNorm`, `GeGLU`.

Importing this package registers the family `"gemma"`, its architectures (`tiny`, `2b`, `7b`) and
its Hugging Face adapter (`model_type` "gemma").
"""

from . import hf as hf
from .config import GemmaConfig as GemmaConfig
from .config import build_gemma as build_gemma
from .model import GeGLU as GeGLU
from .model import Gemma as Gemma
from .model import GemmaRMSNorm as GemmaRMSNorm

__all__ = ["GeGLU", "Gemma", "GemmaConfig", "GemmaRMSNorm", "build_gemma"]
