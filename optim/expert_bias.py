"""Aux-loss-free load balancing (DeepSeek-V3): move each router's expert bias by the sign of its load.

Public names: `balance_experts`, `expert_bias_mask`, `sign_of_load`.

A sigmoid router with a correction bias (`ember.models.layers.Router(expert_bias=True)`) picks
experts on `score + bias`; no loss differentiates the bias. The MoE layer hands the loss a term
that is zero in value and whose gradient with respect to the bias is each expert's token count, so
in the step the bias "gradient" is the load: summed over microbatches and over data-parallel ranks
like any gradient, exact whatever the batch is split into. `sign_of_load(rate)` turns it into
DeepSeek-V3's update `b_e += rate * sign(mean load - load_e)`, and `balance_experts(tx, rate)`
applies it to the bias leaves and `tx` to everything else: clipping, weight decay and moments never
see the counts. The bias lives in the params, so it is saved, restored and sharded with them.

Example:
    >>> import torch
    >>> from ember import optim
    >>> params = {"w": torch.ones(2), "router": {"expert_bias": torch.zeros(4)}}
    >>> tx = optim.balance_experts(optim.sgd(0.1), rate=0.01)
    >>> grads = {"w": torch.ones(2), "router": {"expert_bias": torch.tensor([3.0, 2.0, 0.0, 1.0])}}
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> (updates["router"]["expert_bias"] * 100).tolist()   # experts busier than the mean go down
    [-1.0, -1.0, 1.0, 1.0]
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from ..core.pytree import tree_map, tree_map_with_path
from ..core.types import Params, PyTree
from .base import GradientTransformation, stateless
from .combining import chain
from .masking import masked

__all__ = ["balance_experts", "expert_bias_mask", "sign_of_load"]

BIAS_NAME = "expert_bias"


def expert_bias_mask(params: Params) -> PyTree:
    """True for the routers' `expert_bias` leaves, False elsewhere."""
    return tree_map_with_path(lambda path, _: path.split(".")[-1] == BIAS_NAME, params)


def sign_of_load(rate: Union[float, Tensor]) -> GradientTransformation:
    """`-rate * sign(load - mean load)` over the last (expert) dimension: busy experts' bias goes down.

    A load equal to the mean (all experts equally busy) moves nothing.
    """
    if not rate >= 0:
        raise ValueError(f"sign_of_load: rate must be a number >= 0 (DeepSeek-V3: 0.001), got {rate!r}.")

    def update(updates: PyTree, params: object) -> PyTree:
        return tree_map(lambda g: -rate * torch.sign(g - g.mean(-1, keepdim=True)), updates)

    return stateless(update)


def balance_experts(tx: GradientTransformation, rate: Union[float, Tensor]) -> GradientTransformation:
    """`tx` on every parameter but the routers' expert biases, which move by `sign_of_load(rate)`."""
    return chain(masked(tx, lambda p: tree_map(lambda m: not m, expert_bias_mask(p))),
                 masked(sign_of_load(rate), expert_bias_mask))
