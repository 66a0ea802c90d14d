"""The Mixtral family: `model.py`, `config.py` (config and named sizes), `hf.py`.

Public names: `Mixtral`, `MixtralConfig`, `build_mixtral`.

Mistral's attention with a softmax top-2 mixture of 8 experts in every layer. Importing this package
registers the family `"mixtral"`, its architectures (`tiny`, `8x7b`, `8x22b`) and its Hugging Face
adapter (`model_type` "mixtral").
"""

from . import hf as hf
from .config import MixtralConfig as MixtralConfig
from .config import build_mixtral as build_mixtral
from .model import Mixtral as Mixtral

__all__ = ["Mixtral", "MixtralConfig", "build_mixtral"]
