"""`MoEDecoderConfig`: the hyperparameters of the generic decoder with mixture-of-experts layers.

Public names: `MoEDecoderConfig`.

The fields are Llama's (`Llama3Config`: attention, norms, embeddings, `ffn_dim` for the dense layers)
plus the experts': how many, how wide, how tokens are routed (softmax top-k as Qwen3-MoE and
Mixtral, or DeepSeek-V3's sigmoid routing with a correction bias and expert groups), shared experts,
which layers are dense, how many slots each expert has, and the balancing losses. The MoE families
(`qwen3_moe`, `mixtral`, `dots1`, `deepseek_v3`) subclass it with their defaults and named sizes.

Example:
    >>> cfg = MoEDecoderConfig(n_layers=4, first_dense_layers=1, decoder_sparse_step=2)
    >>> [cfg.is_moe_layer(i) for i in range(4)]
    [False, True, False, True]
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from .. import _checks as checks
from ..llama3.config import Llama3Config

__all__ = ["MoEDecoderConfig"]


@dataclasses.dataclass(frozen=True)
class MoEDecoderConfig(Llama3Config):
    """The fields of a decoder with mixture-of-experts layers (Llama's are `Llama3Config`'s; `ffn_dim` is the
    dense layers' SwiGLU width, HF `intermediate_size`). Each family's config sets its own defaults."""

    n_experts: int = 128
    """Routed experts per MoE layer (HF `num_experts` / `n_routed_experts`)."""
    experts_per_token: int = 8
    """k: experts each token is routed to (HF `num_experts_per_tok`)."""
    moe_ffn_dim: int = 768
    """Inner width of each routed expert (HF `moe_intermediate_size`)."""
    norm_topk_prob: bool = True
    """Rescale each token's k routing weights to sum to one."""
    router: str = "softmax"
    """"softmax" (Qwen3-MoE, Mixtral) or "sigmoid" (DeepSeek-V3: sigmoid scores, selection-only bias)."""
    n_expert_groups: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3 `n_group`; sigmoid router)."""
    topk_groups: int = 1
    """Groups a token may pick its experts from (DeepSeek-V3 `topk_group`)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek-V3)."""
    expert_bias: bool = False
    """A per-expert correction bias on the selection scores (sigmoid router; DeepSeek's aux-loss-free
    balancing: `expert_bias_update_rate` moves it)."""
    expert_bias_update_rate: float = 0.0
    """Each step the bias moves by this much toward balance, `b_e += rate * sign(mean load - load_e)`
    (DeepSeek-V3: 0.001); 0 leaves it fixed."""
    n_shared_experts: int = 0
    """Shared experts every token goes through, as one SwiGLU of width `n * moe_ffn_dim` (DeepSeek-V3)."""
    first_dense_layers: int = 0
    """The first this-many layers are dense (DeepSeek-V3 `first_k_dense_replace`)."""
    decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % step == 0 (HF Qwen3-MoE); other layers are dense."""
    mlp_only_layers: Tuple[int, ...] = ()
    """Layers that are dense whatever the step (HF `mlp_only_layers`)."""
    capacity_factor: Optional[float] = None
    """Slots per expert as a multiple of its even share of a sequence's (token, expert) pairs; pairs
    beyond them are dropped. None: dropless (as many slots as tokens)."""
    dropless: str = "grouped"
    """How dropless routing runs: "grouped" (each expert computes only its own tokens: sorted pairs and
    grouped matmuls, where the kernel runs) or "padded" (every expert a slot per token)."""
    router_aux_loss_coef: float = 0.001
    """Weight of transformers' load-balancing loss, pooled over the MoE layers (0: off)."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE: 0.001; 0: off)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        checks.check_positive(self, "n_experts", "experts_per_token", "moe_ffn_dim", "decoder_sparse_step",
                              "n_expert_groups", "topk_groups")
        checks.check_non_negative(self, "n_shared_experts", "first_dense_layers")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "expert_bias_update_rate", "routed_scaling_factor"):
            if not getattr(self, name) >= 0:  # NaN fails too
                raise ValueError(f"{type(self).__name__}.{name} must be a number >= 0, got {getattr(self, name)!r}.")
        checks.check_choice(self, "router", ("softmax", "sigmoid"))
        checks.check_choice(self, "dropless", ("grouped", "padded"))
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"{type(self).__name__}.experts_per_token={self.experts_per_token} is above n_experts="
                             f"{self.n_experts}: a token picks distinct experts; lower experts_per_token.")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and cf > 0):
            raise ValueError(f"{type(self).__name__}.capacity_factor must be > 0 (e.g. 1.25) or None for dropless "
                             f"routing, got {cf!r}.")
        if self.router == "softmax" and (self.expert_bias or self.n_expert_groups != 1):
            raise ValueError(f"{type(self).__name__}: expert_bias and n_expert_groups belong to router='sigmoid' "
                             f"(DeepSeek-V3); set router='sigmoid', or expert_bias=False and n_expert_groups=1.")
        if self.expert_bias_update_rate > 0 and not self.expert_bias:
            raise ValueError(f"{type(self).__name__}.expert_bias_update_rate={self.expert_bias_update_rate} moves a "
                             f"bias the router does not have; set expert_bias=True (router='sigmoid').")
        g = self.n_expert_groups
        if self.n_experts % g or not 1 <= self.topk_groups <= g:
            raise ValueError(f"{type(self).__name__}: n_expert_groups={g} must divide n_experts={self.n_experts} and "
                             f"topk_groups={self.topk_groups} must be between 1 and n_expert_groups.")
        bad = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.n_layers)]
        if bad:
            raise ValueError(f"{type(self).__name__}.mlp_only_layers names layers {bad} outside "
                             f"0..{self.n_layers - 1}.")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` routes to experts (else it is a dense SwiGLU of `ffn_dim`)."""
        return (layer >= self.first_dense_layers and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)
