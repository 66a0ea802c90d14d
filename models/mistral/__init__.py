"""The Mistral family: `model.py` (what differs from Llama), `config.py` (config and named sizes), `hf.py`.

Public names: `Mistral`, `MistralConfig`, `build_mistral`.

Importing this package registers the family `"mistral"`, its architectures (`tiny`, `7b-v0.1`, `7b`)
and its Hugging Face adapter (`model_type` "mistral").
"""

from . import hf as hf
from .config import MistralConfig as MistralConfig
from .config import build_mistral as build_mistral
from .model import Mistral as Mistral

__all__ = ["Mistral", "MistralConfig", "build_mistral"]
