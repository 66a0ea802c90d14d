"""`DeepseekV3Config` and the named DeepSeek-V3 architectures.

Public names: `DeepseekV3Config`, `build_deepseek_v3`; architectures
`deepseek_v3/{tiny,671b-a37b,1t-a32b}` (registered with `ember.models.arch` when this module is imported).

The routing fields are the generic MoE decoder's (`MoEDecoderConfig`, as dots1 sets them: sigmoid
scores with a correction bias, group-limited top-k, routed scaling, shared experts, leading dense
layers); the attention is multi-head latent attention (`ember.models.layers.LatentAttention`),
whose widths are the five fields below. `n_kv_heads` equals `n_heads` (each head expands its own
key and value), `head_dim` is the rotary width `qk_rope_head_dim` (as transformers sets it; a head's
score width is `qk_head_dim`), and `rope_scaling` is YaRN in the released models. transformers' DeepSeek-V3 has no auxiliary loss:
the released models balanced by moving the bias (`expert_bias_update_rate`, the paper's 0.001),
which stays fixed here unless set. The multi-token-prediction layer of the released files is not
part of the model (transformers skips it too).

Example:
    >>> from ember.models import get_config
    >>> cfg = get_config("deepseek_v3", "671b-a37b")
    >>> cfg.n_experts, cfg.experts_per_token, cfg.kv_lora_rank, cfg.qk_head_dim
    (256, 8, 512, 192)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Union

from .. import _checks as checks
from ..layers import RopeScaling, YarnScaling
from ..moe_decoder.config import MoEDecoderConfig
from ..registry import arch, register_family

if TYPE_CHECKING:
    from .model import DeepseekV3

__all__ = ["DeepseekV3Config", "build_deepseek_v3"]

_YARN_V3 = YarnScaling(factor=40.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                       mscale_all_dim=1.0)


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(MoEDecoderConfig):
    """DeepSeek-V3 hyperparameters; defaults are DeepSeek-V3 (671B params, 37B active)."""

    vocab_size: int = 129280
    max_seq_len: int = 163840
    n_layers: int = 61
    n_heads: int = 128
    n_kv_heads: int = 128
    d_model: int = 7168
    ffn_dim: int = 18432
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Union[RopeScaling, YarnScaling]] = _YARN_V3
    attn_head_dim: Optional[int] = None
    qk_norm: bool = False
    n_experts: int = 256
    experts_per_token: int = 8
    moe_ffn_dim: int = 2048
    norm_topk_prob: bool = True
    router: str = "sigmoid"
    n_expert_groups: int = 8
    topk_groups: int = 4
    routed_scaling_factor: float = 2.5
    expert_bias: bool = True
    n_shared_experts: int = 1
    first_dense_layers: int = 3
    router_aux_loss_coef: float = 0.0
    q_lora_rank: Optional[int] = 1536
    """Width of the queries' low-rank bottleneck (None: queries are one projection; DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the key/value latent that decoding caches."""
    qk_nope_head_dim: int = 128
    """Each head's query/key dimensions without positions."""
    qk_rope_head_dim: int = 64
    """The rotary dimensions: per head for queries, one key part shared by all heads."""
    v_head_dim: int = 128
    """Each head's value width."""
    rope_interleave: bool = True
    """Hugging Face files pair the rotary dimensions interleaved (DeepSeek's layout; False: in halves). ember
    computes in halves either way; only import and export read this."""

    def __post_init__(self) -> None:
        checks.check_positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            checks.check_positive(self, "q_lora_rank")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekV3Config.qk_rope_head_dim must be even (rotary pairs), got "
                             f"{self.qk_rope_head_dim}.")
        super().__post_init__()
        if self.n_kv_heads != self.n_heads or self.qk_norm or self.qkv_bias or self.sliding_window is not None:
            raise ValueError(f"DeepseekV3Config: latent attention has a key and value per head, no q/k norms, biases or "
                             f"window; set n_kv_heads=n_heads ({self.n_heads}), qk_norm=False, qkv_bias=False, "
                             f"sliding_window=None (got {self.n_kv_heads}, {self.qk_norm}, {self.qkv_bias}, "
                             f"{self.sliding_window}).")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(f"DeepseekV3Config.rope_scaling must be a YarnScaling or None (DeepSeek-V3 extends its "
                             f"context with YaRN), got {type(self.rope_scaling).__name__}.")

    @property
    def head_dim(self) -> int:
        """The rotary width, `qk_rope_head_dim` (transformers' `head_dim`)."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """A head's score width, `qk_nope_head_dim + qk_rope_head_dim`."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def build_deepseek_v3(config: DeepseekV3Config) -> "DeepseekV3":
    """The DeepSeek-V3 model for `config` (the family's build function in the registry)."""
    from .model import DeepseekV3

    return DeepseekV3(config)


register_family("deepseek_v3", DeepseekV3Config, build_deepseek_v3)


@arch("deepseek_v3", "tiny")
def _tiny() -> DeepseekV3Config:
    """Byte-level toy model: 3 layers (the first dense), d=128, 4 heads (scores over 32 + 16 dims, values of 32),
    latents of 32 (keys) and 64 (queries), 8 experts of width 64 in 4 groups (2 picked), top-2, one shared, tied."""
    return DeepseekV3Config(vocab_size=256, max_seq_len=256, n_layers=3, n_heads=4, n_kv_heads=4, d_model=128,
                            ffn_dim=384, rope_scaling=None, n_experts=8, experts_per_token=2, moe_ffn_dim=64,
                            n_expert_groups=4, topk_groups=2, first_dense_layers=1, q_lora_rank=64, kv_lora_rank=32,
                            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, tie_embeddings=True)


@arch("deepseek_v3", "671b-a37b")
def _671b_a37b() -> DeepseekV3Config:
    """DeepSeek-V3 and R1 (671B params, 37B active, without the multi-token-prediction layer): the class defaults."""
    return DeepseekV3Config()


@arch("deepseek_v3", "1t-a32b")
def _1t_a32b() -> DeepseekV3Config:
    """Kimi K2 (Moonshot AI, Kimi-K2-Instruct of July 2025; 1.0T params, 32B active): DeepSeek-V3's architecture
    with 384 experts, 64 heads, one expert group, one leading dense layer and a 160k vocabulary (the 0905
    release doubles the YaRN factor to 64)."""
    return DeepseekV3Config(vocab_size=163840, max_seq_len=131072, n_heads=64, n_kv_heads=64, rope_theta=50000.0,
                            rope_scaling=YarnScaling(factor=32.0, original_max_seq_len=4096, beta_fast=1.0,
                                                     beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                            n_experts=384, n_expert_groups=1, topk_groups=1, first_dense_layers=1,
                            routed_scaling_factor=2.827)
