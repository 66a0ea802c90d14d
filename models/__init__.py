"""ember.models: the layer DSL, the GPT-2, Llama-3, Qwen2, Qwen3, Qwen3-MoE, dots1, Mixtral, DeepSeek-V3, Mistral
and Gemma families, and the architecture registry.

Each family is a folder read top to bottom: `llama3/model.py` (attention, MLP, block, model),
`llama3/config.py` (config and named sizes), `llama3/hf.py` (Hugging Face mapping); `gpt2/` likewise.
`qwen2/`, `qwen3/`, `mistral/` and `gemma/` reuse Llama's block and say what their configs change;
`moe_decoder/` is the decoder with mixture-of-experts layers that `qwen3_moe/`, `mixtral/`, `dots1/`
and `deepseek_v3/` configure.

Public names: `layers` (the DSL: `Param`, `Module`, `Linear`, `RMSNorm`, ...), `GPT2`,
`GPT2Config`, `Llama3`, `Llama3Config`, `Qwen2`, `Qwen2Config`, `Qwen3`, `Qwen3Config`, `Qwen3Moe`, `Qwen3MoeConfig`, `Dots1`, `Dots1Config`, `Mixtral`, `MixtralConfig`, `DeepseekV3`, `DeepseekV3Config`, `MoEDecoder`, `MoEDecoderConfig`, `Gemma`, `GemmaConfig`, `Mistral`, `MistralConfig`, `ModelRegistry`, `register_family`, `family`, `arch`,
`get_config`, `build_model`, `list_archs`, `list_families`, `replace_config`, `count_params`, `count_active_params`,
`estimate_memory`, `MemoryEstimate`, `describe`, `check_lm_data`; `Decoder` (KV-cache generation,
`ember.models.generation`); bridges `from_torch`,
`from_hf` / `to_hf` (Hugging Face GPT-2, Llama, Qwen2, Qwen3, Qwen3-MoE, dots1, Mixtral, DeepSeek-V3, Mistral and Gemma folders; other causal LMs
through the bridge); LoRA `to_lora`, `lora_mask`, `merge_lora`; `lm_loss`; preference objectives `dpo_loss`,
`response_logps`, `reference_logps`, `DPOConfig`.

Importing this package registers the built-in families (`gpt2`, `llama3`, `qwen2`, `qwen3`, `qwen3_moe`, `dots1`, `mixtral`,
`deepseek_v3`, `mistral`, `gemma`) and their architectures.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model, count_params
    >>> model = build_model("llama3", "tiny")
    >>> params = model.init(random.key(0))
    >>> logits = model.apply(params, torch.zeros(2, 8, dtype=torch.long))
    >>> logits.shape, logits.dtype, count_params(model) == count_params(params)
    (torch.Size([2, 8, 256]), torch.float32, True)
"""

from . import layers as layers
from .bridge import HF_GPT2_AXES_RULES as HF_GPT2_AXES_RULES
from .bridge import HF_LLAMA_AXES_RULES as HF_LLAMA_AXES_RULES
from .bridge import TorchModel as TorchModel
from .bridge import axes_from_rules as axes_from_rules
from .bridge import from_torch as from_torch
from .dots1 import Dots1 as Dots1
from .dots1 import Dots1Config as Dots1Config
from .gemma import Gemma as Gemma
from .gemma import GemmaConfig as GemmaConfig
from .deepseek_v3 import DeepseekV3 as DeepseekV3
from .deepseek_v3 import DeepseekV3Config as DeepseekV3Config
from .generation import Decoder as Decoder
from .hf import SUPPORTED_HF_MODELS as SUPPORTED_HF_MODELS
from .hf import config_from_hf as config_from_hf
from .hf import config_to_hf as config_to_hf
from .hf import from_hf as from_hf
from .hf import params_from_hf as params_from_hf
from .hf import params_to_hf as params_to_hf
from .hf import to_hf as to_hf
from .lora import LoRAModel as LoRAModel
from .lora import lora_init as lora_init
from .lora import lora_mask as lora_mask
from .lora import lora_targets as lora_targets
from .lora import merge_lora as merge_lora
from .lora import to_lora as to_lora
from .gpt2 import GPT2 as GPT2
from .gpt2 import GPT2Config as GPT2Config
from .llama3 import Llama3 as Llama3
from .llama3 import Llama3Config as Llama3Config
from .mistral import Mistral as Mistral
from .mistral import MistralConfig as MistralConfig
from .mixtral import Mixtral as Mixtral
from .mixtral import MixtralConfig as MixtralConfig
from .moe_decoder import MoEDecoder as MoEDecoder
from .moe_decoder import MoEDecoderConfig as MoEDecoderConfig
from .objectives import check_lm_data as check_lm_data
from .objectives import lm_loss as lm_loss
from .preference import DPOConfig as DPOConfig
from .preference import dpo_loss as dpo_loss
from .preference import reference_logps as reference_logps
from .preference import response_logps as response_logps
from .qwen2 import Qwen2 as Qwen2
from .qwen2 import Qwen2Config as Qwen2Config
from .qwen3 import Qwen3 as Qwen3
from .qwen3 import Qwen3Config as Qwen3Config
from .qwen3_moe import Qwen3Moe as Qwen3Moe
from .qwen3_moe import Qwen3MoeConfig as Qwen3MoeConfig
from .registry import ModelRegistry as ModelRegistry
from .registry import arch as arch
from .registry import build_model as build_model
from .registry import family as family
from .registry import get_config as get_config
from .registry import list_archs as list_archs
from .registry import list_families as list_families
from .registry import register_family as register_family
from .registry import replace_config as replace_config
from .summary import MemoryEstimate as MemoryEstimate
from .summary import count_active_params as count_active_params
from .summary import count_params as count_params
from .summary import describe as describe
from .summary import estimate_memory as estimate_memory

__all__ = [
    "DPOConfig",
    "Decoder",
    "DeepseekV3",
    "DeepseekV3Config",
    "Dots1",
    "Dots1Config",
    "GPT2",
    "GPT2Config",
    "Gemma",
    "GemmaConfig",
    "HF_GPT2_AXES_RULES",
    "HF_LLAMA_AXES_RULES",
    "Llama3",
    "Llama3Config",
    "LoRAModel",
    "MemoryEstimate",
    "Mistral",
    "MistralConfig",
    "MoEDecoder",
    "MoEDecoderConfig",
    "ModelRegistry",
    "Qwen2",
    "Qwen2Config",
    "Qwen3",
    "Qwen3Config",
    "Qwen3Moe",
    "Qwen3MoeConfig",
    "SUPPORTED_HF_MODELS",
    "TorchModel",
    "arch",
    "axes_from_rules",
    "build_model",
    "check_lm_data",
    "config_from_hf",
    "config_to_hf",
    "count_active_params",
    "count_params",
    "describe",
    "dpo_loss",
    "estimate_memory",
    "family",
    "from_hf",
    "from_torch",
    "get_config",
    "layers",
    "list_archs",
    "list_families",
    "lm_loss",
    "lora_init",
    "lora_mask",
    "lora_targets",
    "merge_lora",
    "params_from_hf",
    "params_to_hf",
    "reference_logps",
    "register_family",
    "replace_config",
    "response_logps",
    "to_hf",
    "to_lora",
]
