"""The DeepSeek-V3 family: `model.py`, `config.py` (config and named sizes), `hf.py`.

Public names: `DeepseekV3`, `DeepseekV3Config`, `build_deepseek_v3`.

Multi-head latent attention with DeepSeek's mixture of experts (sigmoid routing with a correction
bias, shared experts, leading dense layers); the architecture of DeepSeek-V3 and R1 and of Kimi K2.
Importing this package registers the family `"deepseek_v3"`, its architectures (`tiny`,
`671b-a37b`, `1t-a32b`) and its Hugging Face adapter (`model_type` "deepseek_v3").
"""

from . import hf as hf
from .config import DeepseekV3Config as DeepseekV3Config
from .config import build_deepseek_v3 as build_deepseek_v3
from .model import DeepseekV3 as DeepseekV3

__all__ = ["DeepseekV3", "DeepseekV3Config", "build_deepseek_v3"]
