"""The generic decoder with mixture-of-experts layers, on which every MoE family is built.

Public names: `MoEBlock`, `MoEDecoder`.

Attention, norms and embeddings are Llama's (`ember.models.llama3`: with q/k norms where the config
says so, as Qwen3-MoE and dots1; DeepSeek-V3 swaps in latent attention). The feed-forward layer of a
MoE block is `ember.models.layers.MoE`: a router picks `experts_per_token` of `n_experts` SwiGLU
experts per token, plus optional shared experts; dense blocks (`first_dense_layers`,
`mlp_only_layers`, `decoder_sparse_step`) keep a SwiGLU.

The blocks carry `(x, router_stats)`: each MoE block adds its router's sums to the stats, so the
balancing losses see every layer (transformers pools its auxiliary loss over layers) while the
step stays one pure function. `features_and_extras` returns them; `ember.models.lm_loss` turns
them into the auxiliary loss, the z-loss and the `moe_*` metrics (`router_losses`).

Parameter tree, on top of Llama's attention and norms (`E = n_experts`, `I = moe_ffn_dim`):

    blocks.{i}.mlp.router.weight        (E, d)
    blocks.{i}.mlp.router.expert_bias   (E,)          sigmoid router with expert_bias
    blocks.{i}.mlp.{gate,up}            (E, I, d)     axes ("expert", "mlp", "embed")
    blocks.{i}.mlp.down                 (E, d, I)     axes ("expert", "embed", "mlp")
    blocks.{i}.mlp.shared.{gate,up,down}              n_shared_experts > 0 (a SwiGLU of width n*I)
    blocks.{i}.mlp.{gate,up,down}.weight              a dense block: Llama's SwiGLU

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import MoEDecoder, MoEDecoderConfig
    >>> cfg = MoEDecoderConfig(vocab_size=256, n_layers=3, n_heads=4, n_kv_heads=2, d_model=64, ffn_dim=128,
    ...                        n_experts=4, experts_per_token=2, moe_ffn_dim=32, first_dense_layers=1)
    >>> model = MoEDecoder(cfg)
    >>> params = model.init(random.key(0))
    >>> sorted(params["blocks"][0]["mlp"]), sorted(params["blocks"][1]["mlp"])
    (['down', 'gate', 'up'], ['down', 'gate', 'router', 'up'])
    >>> hidden, stats = model.features_and_extras(params, torch.zeros(2, 16, dtype=torch.long))
    >>> hidden.shape, float(stats["rows"])     # 2 MoE layers x 32 tokens
    (torch.Size([2, 16, 64]), 64.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from ...core.partition_specs import constrain
from ...core.step_fns import StatisticLeaves
from ...core.types import Key, Params
from ..layers import Module
from ..layers import initializers as inits
from ..layers.axes import RESIDUAL_AXES
from ..layers.moe import MoE, RouterStats, add_router_stats, empty_router_stats, router_losses
from ..layers.moe_router import Router, expert_balance
from ..llama3.model import Block, Llama3, SwiGLU
from .config import MoEDecoderConfig

__all__ = ["MoEBlock", "MoEDecoder"]


@dataclasses.dataclass(frozen=True)
class MoEBlock(Block):
    """Llama's pre-norm block (`Block`: attn, mlp, ln_1, ln_2) over the carry `(x, router_stats)`.

    `mlp` is a `MoE`, which adds its router's stats to the carry, or a dense feed-forward layer.
    """

    merge_totals = staticmethod(add_router_stats)
    """How two microbatches' router stats add, under `pp` (`Stacked`)."""

    def apply(self, params: Params, carry: Tuple[Tensor, RouterStats], *, key: Optional[Key] = None,
              **kwargs: Any) -> Tuple[Tensor, RouterStats]:
        """Args: carry: `(x (B, T, d), stats)`. Returns: the next `(x, stats)`."""
        x, stats = carry
        h = self.call("ln_1", params, x, key=key, **kwargs)
        x = constrain(x + self.call("attn", params, h, key=key, **kwargs), RESIDUAL_AXES)  # (B, T, d)
        h = self.call("ln_2", params, x, key=key, **kwargs)
        y = self.call("mlp", params, h, key=key, **kwargs)
        if isinstance(self.mlp, MoE):
            y, layer_stats = y
            stats = add_router_stats(stats, layer_stats)
        return constrain(x + y, RESIDUAL_AXES), stats


@dataclasses.dataclass(frozen=True)
class MoEDecoder(Llama3):
    """A Llama-layout decoder whose feed-forward layers are mixtures of experts: `apply(params, tokens) -> logits`
    (see `Llama3` for the arguments). The families subclass it with their config.

    Attributes:
        config: the hyperparameters.
    """

    config: MoEDecoderConfig = MoEDecoderConfig()

    def validate(self) -> None:
        if not isinstance(self.config, MoEDecoderConfig):
            raise TypeError(f"{type(self).__name__} needs a MoEDecoderConfig, got {type(self.config).__name__}.")

    def block(self, layer: int, init: inits.Initializer) -> Module:
        c = self.config
        mlp = self.experts(init) if c.is_moe_layer(layer) else self.feed_forward(init)
        return MoEBlock(attn=self.attention(init), mlp=mlp, ln_1=self.norm(), ln_2=self.norm())

    def experts(self, init: inits.Initializer) -> MoE:
        """The feed-forward layer of a MoE block."""
        c = self.config
        router = Router(c.d_model, c.n_experts, c.experts_per_token, style=c.router, renormalize=c.norm_topk_prob,
                        n_groups=c.n_expert_groups, topk_groups=c.topk_groups, scaling=c.routed_scaling_factor,
                        expert_bias=c.expert_bias, weight_init=init)
        shared = None
        if c.n_shared_experts:
            shared = SwiGLU(c.d_model, c.n_shared_experts * c.moe_ffn_dim, gate_init=init, down_init=init)
        return MoE(router, c.moe_ffn_dim, capacity_factor=c.capacity_factor, dropless=c.dropless, shared=shared,
                   expert_init=init)

    def statistic_leaves(self) -> Optional[StatisticLeaves]:
        """The routers' expert biases, which `train_step` moves by their load at `expert_bias_update_rate`
        (never the optimizer); None without them."""
        return expert_balance(self.config.expert_bias_update_rate) if self.config.expert_bias else None

    def carry(self, x: Tensor) -> Tuple[Tensor, RouterStats]:
        return x, empty_router_stats(self.config.n_experts, device=x.device, expert_bias=self.config.expert_bias)

    def uncarry(self, carry: Tuple[Tensor, RouterStats]) -> Tuple[Tensor, RouterStats]:
        return carry

    def auxiliary_loss(self, stats: RouterStats, tokens: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        """`(addend, metrics)`: what the router losses add to a summed token loss over `tokens` tokens.

        The addend is `tokens * (router_aux_loss_coef * aux + router_z_loss_coef * z)`, so the mean
        loss gains the weighted losses as in transformers, plus the expert-bias signal (zero in
        value; its gradient is each expert's load, which `statistic_leaves` turns into the bias's move).
        """
        c = self.config
        aux, z, metrics = router_losses(stats, c.n_experts)
        weight = tokens.detach().to(torch.float32)
        addend = weight * (c.router_aux_loss_coef * aux + c.router_z_loss_coef * z)
        return (addend + stats["bias"] if "bias" in stats else addend), metrics
