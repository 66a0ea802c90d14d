"""The generic decoder with mixture-of-experts layers: `config.py` (`MoEDecoderConfig`), `model.py`
(`MoEBlock`, `MoEDecoder`), `hf.py` (the Hugging Face tensor names MoE decoders share).

Public names: `MoEBlock`, `MoEDecoder`, `MoEDecoderConfig`.

Not a family of its own: `qwen3_moe`, `mixtral`, `dots1` and `deepseek_v3` are this decoder with
their configs (and, for DeepSeek-V3, latent attention).
"""

from .config import MoEDecoderConfig as MoEDecoderConfig
from .model import MoEBlock as MoEBlock
from .model import MoEDecoder as MoEDecoder

__all__ = ["MoEBlock", "MoEDecoder", "MoEDecoderConfig"]
