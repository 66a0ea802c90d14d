"""ember's layer DSL: parameter declarations, a `Module` base, and the transformer layers.

Public names: `Param`, `Module`, `path_key`, `initializers` (module), `Linear`, `Embedding`,
`LayerNorm`, `RMSNorm`, `RotaryEmbedding`, `RopeScaling`, `rope_frequencies`, `apply_rotary`,
`Attention`, `attention_mask`, `repeat_kv`, `MLP`, `SwiGLU`, `ACTIVATIONS`, `Dropout`, `Block`,
`Sequential`, `Stacked`.

Logical axis names used by the built-in layers (the partition-spec rules map them onto mesh axes):
`"vocab"`, `"embed"`, `"heads"` (query heads x head_dim, fused), `"kv_heads"` (key/value heads x
head_dim, fused), `"mlp"`, `"layers"` (the leading axis of `Stacked`), and `None` for dimensions
that are never sharded (learned position tables).

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Block, Attention, MLP, LayerNorm, Stacked
    >>> blk = Block(attn=Attention(32, 4, bias=True), mlp=MLP(32, 128), ln_1=LayerNorm(32), ln_2=LayerNorm(32))
    >>> model = Stacked(blk, num_layers=2)
    >>> params = model.init(random.key(0))
    >>> params["attn"]["wq"]["weight"].shape, model.axes["attn"]["wq"]["weight"]
    (torch.Size([2, 32, 32]), ('layers', 'heads', 'embed'))
    >>> model.apply(params, torch.randn(1, 6, 32)).shape
    torch.Size([1, 6, 32])
"""

from . import initializers as initializers
from .attention import Attention as Attention
from .attention import attention_mask as attention_mask
from .attention import repeat_kv as repeat_kv
from .block import Block as Block
from .dropout import Dropout as Dropout
from .embedding import Embedding as Embedding
from .linear import Linear as Linear
from .mlp import ACTIVATIONS as ACTIVATIONS
from .mlp import MLP as MLP
from .mlp import SwiGLU as SwiGLU
from .module import Module as Module
from .module import path_key as path_key
from .norms import LayerNorm as LayerNorm
from .norms import RMSNorm as RMSNorm
from .param import Param as Param
from .rotary import RopeScaling as RopeScaling
from .rotary import RotaryEmbedding as RotaryEmbedding
from .rotary import apply_rotary as apply_rotary
from .rotary import rope_frequencies as rope_frequencies
from .stacked import Sequential as Sequential
from .stacked import Stacked as Stacked

__all__ = [
    "ACTIVATIONS",
    "Attention",
    "Block",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MLP",
    "Module",
    "Param",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "Sequential",
    "Stacked",
    "SwiGLU",
    "apply_rotary",
    "attention_mask",
    "initializers",
    "path_key",
    "repeat_kv",
    "rope_frequencies",
]
