"""`MoE`: a mixture-of-experts feed-forward layer (routed SwiGLU experts, optional shared experts).

Public names: `MoE`, `RouterStats`, `empty_router_stats`, `router_losses`.

`apply(params, x) -> (y, stats)`: the router picks k experts per token (`moe_router.py`), and the
experts run one of two ways, both with static shapes:

- grouped (dropless; one device, or DTensor data, FSDP and tensor parallelism): the (token, expert)
  pairs as rows sorted by expert and three grouped matmuls over each expert's rows (`moe_grouped.py`):
  no slot is computed for nothing. Under `ep` on DTensor the tokens travel in the padded buffer
  below, and each process computes only the filled slots of its experts the same way.
- padded: the tokens go into a `(G, E, C, d)` buffer (`moe_dispatch.py`, one group per sequence,
  `C` slots per expert: `S` when dropless, fewer with a `capacity_factor`), every expert runs its
  SwiGLU on its slots as one batched matmul over stacked weights, and the outputs come back weighted.
  Under expert parallelism the buffer is constrained from split-by-group (`"batch"`, whose mesh
  axes include `ep`) to split-by-expert (`"expert"` on `ep`): DTensor and GSPMD both lower that
  resharding to an all-to-all, and back. Dropless runs padded on torch_xla and where the grouped
  kernel cannot run (`ember.core.compat.grouped_mm`).

Parameters (`E` experts, width `d`, expert width `I`; the routed experts' weights are stacked):

    router.weight        (E, d)      axes (None, "embed")
    router.expert_bias   (E,)        axes (None,)            sigmoid routing with a correction bias
    gate, up             (E, I, d)   axes ("expert", "mlp", "embed")
    down                 (E, d, I)   axes ("expert", "embed", "mlp")
    shared.*             the shared experts' layer, when there is one

`stats` are the sums the losses need, over the layer's tokens (`RouterStats`): a model adds them
up over its MoE layers and `router_losses` turns them into transformers' pooled auxiliary loss,
the router z-loss and the per-step metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.compat import refuse_where_gated
from ...core.compat.grouped_mm import grouped_mm_row_alignment, grouped_mm_runs
from ...core.mesh import Mesh
from ...core.partition_specs import constrain, current_sharding
from ...core.remat_policies import checkpoint_name
from ...core.types import Key, Params
from . import initializers as inits
from .moe_dispatch import assign_slots, combine, dispatch, expert_capacity
from .moe_grouped import grouped_experts, grouped_experts_on_shards, grouped_slots_on_shards, sort_pairs
from .moe_router import Router, bias_signal
from .module import Module
from .param import Param

__all__ = ["DROPLESS", "MoE", "RouterStats", "check_tensor_parallel", "empty_router_stats", "router_losses"]

RouterStats = Dict[str, Tensor]
"""Sums over tokens and MoE layers, all float32: `counts` (E,) routed pairs per expert, `probs` (E,)
router probabilities per expert, `rows` tokens routed, `z` squared log-sum-exp of the logits,
`pairs` (token, expert) pairs, `dropped` pairs that found their expert full, `max_load` the busiest
expert's load over the mean (the maximum over layers; under `pp`, over microbatches too), and with an
expert bias `bias`, the zero-valued bias signal (without one no stat stays constant through the layers:
Inductor folds such a carry into its loop's input, pytorch/pytorch#146213)."""

DROPLESS = ("grouped", "padded")
_BUFFER_BY_GROUP = ("batch", None, None, "embed")  # (G, E, C, d) as the tokens arrive: split by sequence
_BUFFER_BY_EXPERT = ("batch_no_expert", "expert", None, "embed")  # each device holds its experts' slots


def check_tensor_parallel(mesh: Optional[Mesh], *, compiled: bool) -> None:
    """Refuse a compiled mixture of experts under `tp` on DTensor where torch computes it wrong
    (`WORKAROUNDS["moe_tensor_parallel"]`). Eager is right on every release, and so is torch_xla."""
    tp = 1 if mesh is None else mesh.sizes().get("tp", 1)
    if compiled and tp > 1 and mesh.backend == "dtensor":
        refuse_where_gated("moe_tensor_parallel", (
            f"torch {torch.__version__} compiles a mixture of experts under tensor parallelism (tp={tp}) to a "
            f"wrong step on DTensor (collectives left unwaited; measured on 2.9 and 2.10, right from 2.11): run "
            f"it uncompiled (--backend eager, jit(backend='eager')), drop tp from the mesh, or use torch >= 2.11."))


def _real_tokens(kwargs: Dict[str, Any]) -> Optional[Tensor]:
    """(B, T) bool, False for padding (an `attention_mask` of 0 or a `segment_ids` of 0); None: all real."""
    mask, segments = kwargs.get("attention_mask"), kwargs.get("segment_ids")
    valid = None if mask is None else mask.to(torch.bool)
    if segments is not None:
        valid = segments != 0 if valid is None else valid & (segments != 0)
    return valid


def empty_router_stats(n_experts: int, device: Any = None, *, expert_bias: bool = False) -> RouterStats:
    """Zero stats for a model's first layer (the carry's start); `bias` only for routers with an expert bias."""
    zero = torch.zeros((), device=device)
    stats = {"counts": torch.zeros(n_experts, device=device), "probs": torch.zeros(n_experts, device=device),
             "rows": zero, "z": zero, "pairs": zero, "dropped": zero, "max_load": zero}
    return dict(stats, bias=zero) if expert_bias else stats


def add_router_stats(total: RouterStats, layer: RouterStats) -> RouterStats:
    """`total` with one more layer's stats added (`max_load` keeps the larger)."""
    return {name: torch.maximum(t, layer[name]) if name == "max_load" else t + layer[name]
            for name, t in total.items()}


def router_losses(stats: RouterStats, n_experts: int) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """`(aux_loss, z_loss, metrics)` from a model's summed stats.

    `aux_loss` is transformers' `load_balancing_loss_func`: `E * sum_e f_e * P_e`, with `f_e` the
    routed pairs and `P_e` the router probability of expert e, each divided by the tokens routed
    in all MoE layers together (pooled over layers, not averaged per layer). `z_loss` is the mean
    squared log-sum-exp of the router logits (ST-MoE). Metrics: `moe_aux_loss`, `moe_z_loss`,
    `moe_dropped` (fraction of pairs dropped), `moe_max_load` (busiest expert over the mean).
    """
    rows = stats["rows"].clamp(min=1.0)
    aux = n_experts * torch.sum((stats["counts"] / rows) * (stats["probs"] / rows))
    z = stats["z"] / rows
    metrics = {"moe_aux_loss": aux.detach(), "moe_z_loss": z.detach(),
               "moe_dropped": (stats["dropped"] / stats["pairs"].clamp(min=1.0)).detach(),
               "moe_max_load": stats["max_load"].detach()}
    return aux, z, metrics


@dataclasses.dataclass(frozen=True)
class MoE(Module):
    """Routed SwiGLU experts plus optional shared experts: `apply(params, x) -> (y, stats)`.

    Attributes:
        router: picks the experts (its `n_experts`, `top_k` are the layer's).
        hidden: I, each routed expert's inner width (HF `moe_intermediate_size`).
        capacity_factor: slots per expert and sequence as a multiple of the even share `S * k / E`
            (pairs beyond it are dropped); None: dropless (as `dropless` says). Decoding through a KV
            cache is dropless whatever it is.
        dropless: how dropless routing runs: "grouped" (sorted pairs and grouped matmuls where the
            kernel runs, else padded) or "padded" (a slot per token for every expert).
        shared: a feed-forward layer every token also goes through (DeepSeek-V3's shared experts),
            added unweighted; None for none.
        expert_init: initializer of the expert weights.
        dtype: parameter dtype.
    """

    router: Router
    hidden: int
    capacity_factor: Optional[float] = None
    dropless: str = "grouped"
    shared: Optional[Module] = None
    expert_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

    reads_key = False

    @property
    def n_experts(self) -> int:
        return self.router.n_experts

    def validate(self) -> None:
        if not (isinstance(self.hidden, int) and self.hidden > 0):
            raise ValueError(f"MoE.hidden must be a positive int, got {self.hidden!r}.")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and cf > 0):
            raise ValueError(f"MoE.capacity_factor must be > 0 (1.25 keeps 25% headroom over an even share), or None "
                             f"for dropless routing; got {cf!r}.")
        if self.dropless not in DROPLESS:
            raise ValueError(f"MoE.dropless must be one of {DROPLESS}, got {self.dropless!r}.")

    def declare(self):
        E, I, d = self.n_experts, self.hidden, self.router.d_model

        def weight(shape, axes):
            return Param(shape, init=self.expert_init, axes=axes, dtype=self.dtype)

        spec = {
            "router": self.router,
            "gate": weight((E, I, d), ("expert", "mlp", "embed")),
            "up": weight((E, I, d), ("expert", "mlp", "embed")),
            "down": weight((E, d, I), ("expert", "embed", "mlp")),
        }
        if self.shared is not None:
            spec["shared"] = self.shared
        return spec

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None,
              **kwargs: Any) -> Tuple[Tensor, RouterStats]:
        """Args: x: (B, T, d); in kwargs, `attention_mask` (B, T, 0 for padding) or `segment_ids` (B, T, 0
        for padding, as ember's packer and MaxText's mark it) leave padding out of the capacity slots and
        the stats. Returns: `(y (B, T, d), stats)`."""
        sharding = current_sharding()
        if sharding is not None:
            check_tensor_parallel(sharding.mesh, compiled=torch.compiler.is_compiling())
        B, T, d = x.shape
        E, k = self.n_experts, self.router.top_k
        routing = self.call("router", params, x.reshape(B * T, d), **kwargs)
        # Decoding through a KV cache (prefill and steps) is dropless: a step sees one token, so capacity
        # could not drop what a full forward drops, and the two would disagree.
        capacity_factor = None if kwargs.get("kv_cache") is not None else self.capacity_factor
        valid = _real_tokens(kwargs)
        grouped = self._grouped(params, x, routing, valid, sharding) if capacity_factor is None else None
        if grouped is not None:
            y, load = grouped
            dropped = torch.zeros((), device=x.device)
        else:
            C = expert_capacity(T, k, E, capacity_factor)
            slots = assign_slots(routing.indices.view(B, T, k), E, C, valid)
            buffer = constrain(dispatch(x, slots, E, C), _BUFFER_BY_GROUP)  # (B, E, C, d)
            buffer = constrain(buffer, _BUFFER_BY_EXPERT)  # the all-to-all under expert parallelism
            out = self._grouped_slots(params, buffer, slots.counts, sharding) if capacity_factor is None else None
            out = constrain(self._experts(params, buffer) if out is None else out, _BUFFER_BY_EXPERT)  # (B, E, C, d)
            out = constrain(out, _BUFFER_BY_GROUP)  # and back
            y = combine(out, slots, routing.weights.view(B, T, k)).to(x.dtype)  # (B, T, d)
            load, dropped = slots.counts.sum(0), slots.dropped
        if self.shared is not None:
            y = y + self.call("shared", params, x, **kwargs)
        return y, self._stats(params, routing, load, dropped, valid)

    def _grouped(self, params: Params, x: Tensor, routing: Any, valid: Optional[Tensor],
                 sharding: Any) -> Optional[Tuple[Tensor, Tensor]]:
        """`(y (B, T, d), load (E,))` of dropless routing as sorted pairs and grouped matmuls; None where
        it does not run: not asked for, the kernel cannot, torch_xla, or a mesh with `ep` (the padded
        buffer is the exchange; `_grouped_slots` computes its filled slots) or a layout other than data,
        fully sharded and tensor parallelism."""
        B, T, d = x.shape
        align = self._grouped_alignment(x)
        if align is None:
            return None
        tokens, flat_valid = x.reshape(B * T, d), None if valid is None else valid.reshape(B * T)
        if sharding is None:
            pairs = sort_pairs(routing.indices, self.n_experts, flat_valid, align)
            y, load = grouped_experts(params, tokens, pairs, routing.weights), pairs.counts
        elif sharding.mesh.backend == "dtensor" and sharding.mesh.sizes().get("ep", 1) == 1:
            done = grouped_experts_on_shards(params, tokens, routing.indices, routing.weights, flat_valid,
                                             self.n_experts, align)
            if done is None:
                return None
            y, load = done
        else:
            return None
        return y.view(B, T, d).to(x.dtype), load

    def _grouped_slots(self, params: Params, buffer: Tensor, counts: Tensor, sharding: Any) -> Optional[Tensor]:
        """The filled slots of the experts each process holds under `ep` on DTensor, as grouped matmuls
        (`grouped_slots_on_shards`); None where that does not run (then every slot is computed)."""
        align = self._grouped_alignment(buffer)
        if align is None or sharding is None or sharding.mesh.backend != "dtensor":
            return None
        counts = constrain(counts, _BUFFER_BY_EXPERT[:2])  # (G, E): where the buffer's slots are
        return grouped_slots_on_shards(params, buffer, counts, align)

    def _grouped_alignment(self, x: Tensor) -> Optional[int]:
        """The grouped kernel's row alignment for rows like `x`'s last dimension; None where dropless is not
        asked to run grouped or the kernel cannot run these (`ember.core.compat.grouped_mm`)."""
        if self.dropless != "grouped" or not grouped_mm_runs(x.dtype, x.device.type, x.shape[-1], self.hidden):
            return None
        return grouped_mm_row_alignment(x.dtype, x.device.type)

    def _experts(self, params: Params, buffer: Tensor) -> Tensor:
        """Every expert's SwiGLU on its slots. Args: buffer: (G, E, C, d). Returns: (G, E, C, d)."""
        gate = torch.einsum("gecd,eid->geci", buffer, params["gate"])
        up = torch.einsum("gecd,eid->geci", buffer, params["up"])
        h = checkpoint_name(F.silu(gate) * up, "mlp_hidden")  # (G, E, C, I)
        return torch.einsum("geci,edi->gecd", h, params["down"])

    def _stats(self, params: Params, routing: Any, load: Tensor, dropped: Tensor,
               valid: Optional[Tensor]) -> RouterStats:
        """This layer's `RouterStats` from `load` (E,), the pairs of real tokens per expert, and the pairs
        `dropped`; tokens where `valid` is False count for nothing."""
        N, k = routing.indices.shape
        w = torch.ones(N, device=routing.logits.device) if valid is None else valid.reshape(N).to(torch.float32)
        stats = {
            "counts": load,
            "probs": (routing.probs * w.unsqueeze(-1)).sum(0),
            "rows": w.sum(),
            "z": (torch.logsumexp(routing.logits, dim=-1).square() * w).sum(),
            "pairs": w.sum() * k,
            "dropped": dropped,
            "max_load": (load.max() / load.mean().clamp(min=1e-9)).detach(),
        }
        bias = params["router"].get("expert_bias")
        if bias is not None:
            stats["bias"] = bias_signal(bias, load)
        return stats
