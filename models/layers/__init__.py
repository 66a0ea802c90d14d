"""ember's layer DSL: parameter declarations, a `Module` base, and the primitives model families share.

Public names: `Param`, `Module`, `path_key`, `initializers` (module), `Linear`, `Embedding`,
`LayerNorm`, `RMSNorm`, `Dropout`, `RotaryEmbedding`, `RopeScaling`, `YarnScaling`, `rope_frequencies`,
`apply_rotary`, `dot_product_attention`, `attention_mask`, `repeat_kv`, `LatentAttention` (multi-head
latent attention, shared by the DeepSeek-V3 family), `Sequential`, `Stacked`, `Stacks`, `as_list`, `init_kv_cache`,
`init_cache_buffers`, `CachedCall` (the decoding cache).

Attention, feed-forward layers and blocks live with their family, on the page of its `model.py`
(`ember.models.llama3`: `Attention`, `SwiGLU`, `Block`; `ember.models.gpt2`: `CausalSelfAttention`,
`MLP`, `Block`). The old names `layers.Attention`, `layers.SwiGLU`, `layers.MLP`, `layers.Block` and
`layers.ACTIVATIONS` still resolve there, with a `DeprecationWarning`.

Logical axis names used by the built-in layers are listed in `axes.py`; the partition-spec rules
map them onto mesh axes.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Linear, Stacked
    >>> model = Stacked(Linear(32, 32, in_axis="embed", out_axis="embed"), num_layers=2)
    >>> params = model.init(random.key(0))
    >>> params["weight"].shape, model.axes["weight"]
    (torch.Size([2, 32, 32]), ('layers', 'embed', 'embed'))
    >>> model.apply(params, torch.randn(1, 6, 32)).shape
    torch.Size([1, 6, 32])
"""

import importlib
import warnings
from typing import Any

from . import initializers as initializers
from .attention import attention_mask as attention_mask
from .attention import dot_product_attention as dot_product_attention
from .attention import repeat_kv as repeat_kv
from .dropout import Dropout as Dropout
from .embedding import Embedding as Embedding
from .kv_cache import CachedCall as CachedCall
from .kv_cache import init_cache_buffers as init_cache_buffers
from .kv_cache import init_kv_cache as init_kv_cache
from .latent_attention import LatentAttention as LatentAttention
from .linear import Linear as Linear
from .module import Module as Module
from .module import path_key as path_key
from .norms import LayerNorm as LayerNorm
from .norms import RMSNorm as RMSNorm
from .param import Param as Param
from .rotary import RopeScaling as RopeScaling
from .rotary import RotaryEmbedding as RotaryEmbedding
from .rotary import YarnScaling as YarnScaling
from .rotary import apply_rotary as apply_rotary
from .rotary import rope_frequencies as rope_frequencies
from .stacked import as_list as as_list
from .stacked import Sequential as Sequential
from .stacked import Stacked as Stacked
from .stacked import Stacks as Stacks

__all__ = [
    "CachedCall",
    "Dropout",
    "Embedding",
    "LatentAttention",
    "LayerNorm",
    "Linear",
    "Module",
    "Param",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "Sequential",
    "Stacked",
    "Stacks",
    "YarnScaling",
    "apply_rotary",
    "as_list",
    "attention_mask",
    "dot_product_attention",
    "init_cache_buffers",
    "init_kv_cache",
    "initializers",
    "path_key",
    "repeat_kv",
    "rope_frequencies",
]

_MOVED = {  # old name here -> the module that now defines it (same name, same constructor)
    "ACTIVATIONS": "ember.models.gpt2",
    "Attention": "ember.models.llama3",
    "Block": "ember.models.gpt2",
    "MLP": "ember.models.gpt2",
    "SwiGLU": "ember.models.llama3",
}


def __getattr__(name: str) -> Any:
    """Resolve the names that moved to a family package, with a `DeprecationWarning`."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    target = _MOVED[name]
    warnings.warn(
        f"ember.models.layers.{name} moved to {target}.{name}; the old path is removed in ember 0.3. "
        f"Import it from {target}.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(target), name)
