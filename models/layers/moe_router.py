"""`Router`: which experts each token goes to, and with what weight (top-k routing).

Public names: `Router`, `Routing`, `bias_signal`, `expert_balance`.

Two styles, as the released models route:

* `"softmax"` (Qwen3-MoE, Mixtral, OLMoE): softmax over the expert logits, the k largest kept,
  renormalised to sum to one when `renormalize` (Qwen3-MoE's `norm_topk_prob`; Mixtral always,
  OLMoE never).
* `"sigmoid"` (DeepSeek-V3, dots.llm1): a sigmoid score per expert. The experts are picked on the
  score plus a per-expert correction bias (the aux-loss-free balancing bias, `expert_bias`), after
  keeping only the `topk_groups` best of `n_groups` expert groups (a group ranks by the sum of its
  two best biased scores); the weights are the unbiased scores of the picked experts, renormalised
  when `renormalize`, times `scaling` (`routed_scaling_factor`).

The bias is a parameter (saved and sharded like one, float32 whatever the compute dtype) that no loss
differentiates: the MoE layer hands the loss each expert's load as its gradient (`bias_signal`), and
`train_step` moves it by DeepSeek-V3's rule `b_e += rate * sign(mean load - load_e)`
(`expert_balance`, which `ember.models.lm_loss` hands the step), never by the optimizer.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> router = Router(d_model=8, n_experts=4, top_k=2)
    >>> r = router.apply(router.init(random.key(0)), torch.randn(5, 8))
    >>> r.indices.shape, r.weights.shape, r.logits.shape
    (torch.Size([5, 2]), torch.Size([5, 2]), torch.Size([5, 4]))
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from ...core.pytree import tree_map_with_path
from ...core.step_fns import StatisticLeaves
from ...core.types import Key, Params, PyTree
from . import initializers as inits
from .moe_dispatch import one_hot
from .module import Module
from .param import Param

__all__ = ["Router", "Routing", "bias_signal", "expert_balance"]

BIAS_NAME = "expert_bias"

STYLES = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """What a router decided for `N` tokens.

    Attributes:
        indices: (N, k) int64, the chosen experts of each token.
        weights: (N, k), the weight of each chosen expert's output.
        logits: (N, E) float32 router logits (the z-loss reads them).
        probs: (N, E) float32, each token's affinity to every expert, summing to one (the auxiliary
            loss reads them: softmax of the logits, or the normalised sigmoid scores).
    """

    indices: Tensor
    weights: Tensor
    logits: Tensor
    probs: Tensor


@dataclasses.dataclass(frozen=True)
class Router(Module):
    """A linear gate `(N, d) -> (N, E)` and top-k selection.

    Attributes:
        d_model: token width.
        n_experts: E, the routed experts.
        top_k: k, experts per token (1 <= k <= E).
        style: `"softmax"` or `"sigmoid"` (see the module docstring).
        renormalize: rescale the k weights of a token to sum to one.
        n_groups: expert groups for group-limited routing (sigmoid only; must divide E).
        topk_groups: how many groups a token may pick experts from.
        scaling: multiplies the weights (DeepSeek-V3's `routed_scaling_factor`).
        expert_bias: learnable-by-counts correction bias on the selection scores (sigmoid only).
        weight_init: initializer of the gate weight `(E, d)`.
        dtype: parameter dtype.
    """

    d_model: int
    n_experts: int
    top_k: int
    style: str = "softmax"
    renormalize: bool = False
    n_groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0
    expert_bias: bool = False
    weight_init: inits.Initializer = inits.normal(0.02)
    dtype: torch.dtype = torch.float32

    reads_key = False

    def validate(self) -> None:
        E, k = self.n_experts, self.top_k
        if not (isinstance(E, int) and E > 0):
            raise ValueError(f"Router.n_experts must be a positive int, got {E!r}.")
        if not (isinstance(k, int) and 1 <= k <= E):
            raise ValueError(f"Router.top_k={k!r} must be between 1 and n_experts={E}: a token cannot pick more "
                             f"experts than there are; lower top_k or raise n_experts.")
        if self.style not in STYLES:
            raise ValueError(f"Router.style must be one of {STYLES}, got {self.style!r}.")
        if self.style == "softmax" and (self.n_groups != 1 or self.expert_bias):
            raise ValueError("Router: group-limited routing and the correction bias need style='sigmoid' "
                             "(DeepSeek-V3); set n_groups=1 and expert_bias=False for softmax routing.")
        g, tg = self.n_groups, self.topk_groups
        if not (isinstance(g, int) and g > 0 and E % g == 0):
            raise ValueError(f"Router.n_groups={g!r} must divide n_experts={E} into equal groups.")
        if not (isinstance(tg, int) and 1 <= tg <= g) or tg * (E // g) < k:
            raise ValueError(f"Router.topk_groups={tg!r} must be in [1, n_groups={g}] and leave at least top_k={k} "
                             f"experts to pick from ({E // g} per group).")
        if g > 1 and E // g < 2:
            raise ValueError(f"Router: groups rank by their two best experts; n_groups={g} leaves {E // g} per group.")

    def declare(self):
        spec = {"weight": Param((self.n_experts, self.d_model), init=self.weight_init, axes=(None, "embed"),
                                dtype=self.dtype)}
        if self.expert_bias:
            spec[BIAS_NAME] = Param((self.n_experts,), init=inits.zeros(), axes=(None,), dtype=torch.float32)
        return spec

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Routing:
        """Args: x: (N, d) tokens. Returns: the `Routing` of the N tokens (float32 weights)."""
        logits = torch.nn.functional.linear(x.float(), params["weight"].float())  # (N, E)
        if self.style == "softmax":
            probs = torch.softmax(logits, dim=-1)  # (N, E)
            weights, indices = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        else:
            scores = torch.sigmoid(logits)  # (N, E)
            indices = self._sigmoid_choice(scores, params.get("expert_bias"))  # (N, k)
            weights = scores.gather(1, indices)  # (N, k)
            probs = scores / scores.sum(-1, keepdim=True)  # (N, E)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.style == "sigmoid" else 0.0))
        weights = weights * self.scaling if self.scaling != 1.0 else weights
        return Routing(indices, weights, logits, probs)

    def _sigmoid_choice(self, scores: Tensor, bias: Optional[Tensor]) -> Tensor:
        """The k experts of each token: best biased scores within the `topk_groups` best groups."""
        choice = (scores + bias if bias is not None else scores).detach()  # (N, E), selection only
        if self.n_groups > 1:
            N, E, G = choice.shape[0], self.n_experts, self.n_groups
            grouped = choice.view(N, G, E // G)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
            picked = torch.topk(group_scores, self.topk_groups, dim=-1).indices  # (N, topk_groups)
            allowed = one_hot(picked, G, torch.bool).any(1)  # (N, G); a scatter into zeros broke torch 2.9's Inductor
            allowed = allowed.unsqueeze(-1).expand(N, G, E // G).reshape(N, E)
            choice = choice.masked_fill(~allowed, float("-inf"))
        return torch.topk(choice, self.top_k, dim=-1).indices  # (N, k)


def bias_signal(bias: Tensor, counts: Tensor) -> Tensor:
    """0-d, exactly zero, whose gradient with respect to `bias` is `counts` (detached)."""
    return ((bias - bias.detach()) * counts.detach().to(bias.dtype)).sum()


def expert_bias_mask(params: Params) -> PyTree:
    """True at the routers' expert-bias leaves, False elsewhere."""
    return tree_map_with_path(lambda path, _: path.split(".")[-1] == BIAS_NAME, params)


def expert_balance(rate: float) -> StatisticLeaves:
    """The expert biases as `train_step` moves them: `b -= rate * sign(load - mean load)` per router.

    Busy experts' biases go down, idle ones' up; a load equal to the mean moves nothing, and so
    does `rate = 0` (a bias kept as loaded, e.g. for fine-tuning).
    """
    if not (isinstance(rate, (int, float)) and rate >= 0):
        raise ValueError(f"expert_bias_update_rate must be a number >= 0 (DeepSeek-V3: 0.001), got {rate!r}.")

    def move(load: Tensor, bias: Tensor) -> Tensor:
        return bias - rate * torch.sign(load - load.mean(-1, keepdim=True)).to(bias.dtype)

    return StatisticLeaves(mask=expert_bias_mask, move=move)
