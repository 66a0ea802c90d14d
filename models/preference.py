"""Preference optimization objectives over ember models: DPO, IPO, hinge, robust DPO, SimPO, ORPO.

Public names: `dpo_loss`, `response_logps`, `reference_logps`, `DPOConfig`, `PAIR_KEYS`.

A preference batch holds `B` pairs, each side padded to the same `(B, T)` windows as SFT's (targets
already shifted, -100 on the prompt and the padding):

    chosen_inputs, chosen_targets, rejected_inputs, rejected_targets      (B, T) int64
    chosen_<x>, rejected_<x>                                            extra model inputs (positions, ...)
    ref_chosen_logps, ref_rejected_logps                                (B,) float32, optional

A pair lives in one row of both sides, so splitting the batch along dim 0 (microbatches,
data-parallel ranks) never separates a chosen from its rejected. The policy runs once on both sides
stacked (`(2B, T)`, TRL's concatenated forward). The reference is, in this order: the batch's
precomputed `ref_*_logps`; the state's frozen parameters (`TrainStateWithFrozen(frozen=...)`,
passed as `frozen=`); or, for a LoRA policy, its base with the adapters off (no second copy of the
weights). The loss is a `TokenLoss` over pairs (`tokens` in the step's metrics counts pairs), so
microbatches and ranks average exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..core.config_checks import check_fields, finite_positive
from ..core.pytree import tree_leaves_with_path, tree_map
from ..core.step_fns.preference_losses import (
    REFERENCE_FREE,
    check_loss_type,
    preference_losses,
    sft_loss,
)
from ..core.step_fns.sequence_logps import SequenceLogps, chunked_token_logps, sequence_logps, token_logps
from ..core.step_fns.token_loss import TokenLoss
from ..core.types import Batch, Key, Params
from .objectives import forward_for_loss, loss_chunk_size, with_statistic_leaves

__all__ = ["DPOConfig", "PAIR_KEYS", "dpo_loss", "reference_logps", "response_logps"]

PAIR_KEYS = ("chosen_inputs", "chosen_targets", "rejected_inputs", "rejected_targets")
_REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """A preference run's objective (`--config dpo`: `--dpo.loss ipo --dpo.beta 0.5`), read when data.source=preference."""

    loss: str = "sigmoid"
    """sigmoid (DPO), hinge, ipo, robust, simpo or orpo (the last two read no reference)."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward (ORPO's lambda)."""
    label_smoothing: float = 0.0
    """Probability that a pair's label is flipped (sigmoid: conservative DPO; robust; simpo)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin."""
    sft_weight: Optional[float] = None
    """Weight of the chosen responses' NLL per token (RPO's alpha); None: 1 for orpo, else 0."""
    precompute_reference: bool = False
    """Score every pair with the initial weights once before training and train without a copy of them."""

    def __post_init__(self) -> None:
        check_loss_type(self.loss, where="--dpo.loss")
        check_fields(self, "dpo.", beta=finite_positive)
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing}: expected a probability in [0, 0.5); "
                             f"pass e.g. --dpo.label_smoothing 0.1.")

    def loss_fn(self, model: Any) -> Callable[..., Any]:
        """`dpo_loss(model, ...)` with these settings."""
        return dpo_loss(model, loss=self.loss, beta=self.beta, label_smoothing=self.label_smoothing,
                        simpo_gamma=self.simpo_gamma, sft_weight=self.sft_weight)

    def needs_reference(self, model: Any) -> bool:
        """Whether the run holds a frozen copy of the initial weights: a reference loss on a model without
        LoRA (a LoRA policy's reference is its own base, the adapters off)."""
        return self.loss not in REFERENCE_FREE and not _is_lora(model) and not self.precompute_reference


def response_logps(model: Any, params: Params, inputs: Tensor, targets: Tensor, *, key: Optional[Key] = None,
                   ignore_index: int = -100, **extra: Tensor) -> Tuple[Tensor, Any]:
    """`((B, T) per-token log-probabilities of the targets, router stats or None)` under `model`.

    Chunked over tokens when the model's config sets `loss_chunk_size` (the `(B, T, V)` logits never
    exist); a mixture of experts also returns its router stats (for `auxiliary_loss`).
    """
    chunk_size = loss_chunk_size(model)
    out, stats = forward_for_loss(model, params, inputs, key=key, chunked=bool(chunk_size), **extra)
    if chunk_size:
        name, head = model.head()
        return chunked_token_logps(head, params[name], out, targets, chunk_size=chunk_size,
                                   ignore_index=ignore_index), stats
    return token_logps(out, targets, ignore_index=ignore_index), stats


def dpo_loss(model: Any, *, loss: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
             simpo_gamma: float = 0.5, sft_weight: Optional[float] = None,
             ignore_index: int = -100) -> Callable[..., Any]:
    """A preference loss of `model` on pair batches (see the module docstring), for `train_step`.

    Args:
        model: an ember model (native family, `from_torch` bridge, or `to_lora`'s LoRA model).
        loss: `sigmoid` (DPO), `hinge`, `ipo`, `robust`, `simpo`, `orpo` (`PREFERENCE_LOSSES`).
        beta: the inverse temperature (ORPO's lambda).
        label_smoothing: label noise for `sigmoid` (conservative DPO), `robust`, `simpo`.
        simpo_gamma: SimPO's target margin.
        sft_weight: weight of the chosen responses' per-token NLL added to the loss (RPO's alpha;
            ORPO's is 1, the default for `orpo`; 0 for the others).
        ignore_index: the target value of unscored positions.

    Returns:
        `loss_fn(params, batch, *, key, frozen=None) -> (TokenLoss(sum of pair losses, pairs), metrics)`
        with metrics `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`,
        `logps/chosen`, `logps/rejected` (means over pairs), `identical_pairs` (the fraction whose
        chosen equals rejected) and, with an SFT term, `sft_loss`.
    """
    check_loss_type(loss, where="dpo_loss(loss=...)")
    if not beta > 0:
        raise ValueError(f"dpo_loss(beta=...) must be > 0, got {beta!r}.")
    sft_weight = (1.0 if loss == "orpo" else 0.0) if sft_weight is None else float(sft_weight)
    routed = callable(getattr(model, "auxiliary_loss", None))

    def loss_fn(params: Params, batch: Batch, *, key: Optional[Key] = None, frozen: Optional[Params] = None) -> Any:
        missing = [k for k in PAIR_KEYS if k not in batch]
        if missing:
            raise KeyError(f"dpo_loss: the batch lacks {missing}; a preference batch has {list(PAIR_KEYS)} "
                           f"(ember.data.make_preference_pipeline builds them).")
        pairs = batch["chosen_inputs"].shape[0]
        inputs, targets, extra = _stacked(batch)
        per_token, stats = response_logps(model, params, inputs, targets, key=key, ignore_index=ignore_index, **extra)
        chosen, rejected = _split_pairs(sequence_logps(per_token, targets, ignore_index=ignore_index), pairs)
        ref_chosen, ref_rejected = (None, None) if loss in REFERENCE_FREE else _reference(
            model, params, batch, frozen, inputs, targets, extra, key, ignore_index, pairs)
        out = preference_losses(chosen, rejected, ref_chosen, ref_rejected, loss_type=loss, beta=beta,
                                label_smoothing=label_smoothing, simpo_gamma=simpo_gamma)
        total = out.losses.sum()
        metrics = _metrics(out, chosen, rejected, batch, loss)
        if sft_weight:
            nll = sft_loss(chosen)
            total = total + sft_weight * nll * pairs
            metrics["sft_loss"] = nll.detach()
        if routed:  # router losses: their per-token mean, once per pair like the other terms
            scored = (targets != ignore_index).sum()
            extra_total, router_metrics = model.auxiliary_loss(stats, scored)
            total = total + extra_total / scored.clamp(min=1).to(extra_total.dtype) * pairs
            metrics.update(router_metrics)
        count = torch.full((), pairs, dtype=torch.float32, device=total.device)
        return TokenLoss(total, count), metrics

    return with_statistic_leaves(loss_fn, model)


def reference_logps(model: Any, params: Params, rows: Dict[str, Any], *, batch_size: int = 8,
                    device: Any = None) -> Tuple[Any, Any]:
    """The summed log-probabilities of every pair's chosen and rejected responses under `params`, no gradient.

    `rows` are `PreferencePairs.rows` (numpy `(N, T)`); returns two float32 numpy arrays `(N,)`, for
    `make_preference_pipeline(reference_logps=...)`: the step then reads them instead of running a reference.
    """
    out = []
    n = len(rows["chosen_inputs"])
    with torch.no_grad():
        for start in range(0, n, batch_size):
            part = {k: torch.as_tensor(rows[k][start:start + batch_size], device=device) for k in PAIR_KEYS}
            inputs, targets, extra = _stacked(part)
            out.append(_summed(model, params, inputs, targets, extra).float().cpu().reshape(2, -1))
    both = torch.cat(out, dim=1).numpy() if out else torch.zeros(2, 0).numpy()
    return both[0], both[1]


def _stacked(batch: Batch) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """Chosen over rejected, `(2B, T)`, and the extra model inputs stacked the same way."""
    c_in, r_in = batch["chosen_inputs"], batch["rejected_inputs"]
    if c_in.shape != r_in.shape or batch["chosen_targets"].shape != c_in.shape:
        raise ValueError(f"dpo_loss: chosen and rejected must be padded to the same (B, T); got chosen_inputs "
                         f"{tuple(c_in.shape)}, rejected_inputs {tuple(r_in.shape)}, chosen_targets "
                         f"{tuple(batch['chosen_targets'].shape)}.")
    extra = {}
    for name in batch:
        if name.startswith("chosen_") and name not in PAIR_KEYS:
            field = name[len("chosen_"):]
            extra[field] = torch.cat([batch[name], batch["rejected_" + field]])
    return torch.cat([c_in, r_in]), torch.cat([batch["chosen_targets"], batch["rejected_targets"]]), extra


def _split_pairs(logps: SequenceLogps, pairs: int) -> Tuple[SequenceLogps, SequenceLogps]:
    return (SequenceLogps(logps.total[:pairs], logps.count[:pairs]),
            SequenceLogps(logps.total[pairs:], logps.count[pairs:]))


def _reference(model: Any, params: Params, batch: Batch, frozen: Optional[Params], inputs: Tensor, targets: Tensor,
               extra: Dict[str, Tensor], key: Optional[Key], ignore_index: int, pairs: int) -> Tuple[Tensor, Tensor]:
    """The reference's summed log-probabilities of the chosen and rejected responses, `(B,)` each, no gradient."""
    if all(k in batch for k in _REFERENCE_KEYS):
        return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    if frozen is not None:
        ref_model, ref_params, like = model, frozen, params
        if _is_lora(model) and not (isinstance(frozen, dict) and set(frozen) == {"base", "lora"}):
            ref_model, like = model.base, params["base"]  # a LoRA policy against a plain reference checkpoint
        _check_reference(ref_params, like)
    elif _is_lora(model):
        ref_model, ref_params = model.base, params["base"]  # the adapters off: the policy's own base weights
    else:
        raise ValueError(
            "dpo_loss: the loss compares the policy with a reference, and there is none: hold one in the state "
            "(`TrainStateWithFrozen.create(params=..., tx=..., frozen=reference_params)`), precompute "
            "`ref_chosen_logps` / `ref_rejected_logps` into the batch, train a LoRA policy (the base is the "
            f"reference), or use a reference-free loss ({', '.join(REFERENCE_FREE)}).")
    ref_params = tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, ref_params)
    total = _summed(ref_model, ref_params, inputs, targets, extra, key=key, ignore_index=ignore_index)
    return total[:pairs], total[pairs:]


def _summed(model: Any, params: Params, inputs: Tensor, targets: Tensor, extra: Dict[str, Tensor], *,
            key: Optional[Key] = None, ignore_index: int = -100) -> Tensor:
    """The summed log-probabilities of each row's scored targets, `(2B,)`."""
    per_token, _ = response_logps(model, params, inputs, targets, key=key, ignore_index=ignore_index, **extra)
    return sequence_logps(per_token, targets, ignore_index=ignore_index).total


def _is_lora(model: Any) -> bool:
    return hasattr(model, "merged") and hasattr(model, "base") and hasattr(model, "rank")


def _check_reference(ref_params: Params, policy_params: Params) -> None:
    """One line naming the first leaf whose shape differs from the policy's, when the reference is another
    architecture (read from the trees themselves: no parameter shapes built on each call)."""
    want = {p: tuple(t.shape) for p, t in tree_leaves_with_path(policy_params) if isinstance(t, Tensor)}
    got = {p: tuple(t.shape) for p, t in tree_leaves_with_path(ref_params) if isinstance(t, Tensor)}
    if want == got:
        return
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(p for p in set(want) & set(got) if want[p] != got[p])
    first = (f"{differ[0]} is {got[differ[0]]} in the reference, {want[differ[0]]} in the policy" if differ
             else f"the reference lacks {missing[:2]}" if missing else f"the reference has extra {extra[:2]}")
    raise ValueError(f"dpo_loss: the reference does not match the policy's architecture ({first}); load the "
                     f"reference from a checkpoint of the same family and size (--init_from the SFT folder).")


def _metrics(out: Any, chosen: SequenceLogps, rejected: SequenceLogps, batch: Batch, loss: str) -> Dict[str, Tensor]:
    per_token = loss in REFERENCE_FREE  # TRL's CPO / ORPO log mean log-probabilities
    c = (chosen.mean() if per_token else chosen.total).detach()
    r = (rejected.mean() if per_token else rejected.total).detach()
    same = (batch["chosen_inputs"] == batch["rejected_inputs"]).all(-1) & (
        batch["chosen_targets"] == batch["rejected_targets"]).all(-1)
    return {
        "rewards/chosen": out.chosen_rewards.mean(),
        "rewards/rejected": out.rejected_rewards.mean(),
        "rewards/accuracies": (out.chosen_rewards > out.rejected_rewards).float().mean(),
        "rewards/margins": (out.chosen_rewards - out.rejected_rewards).mean(),
        "logps/chosen": c.mean(),
        "logps/rejected": r.mean(),
        "identical_pairs": same.float().mean(),
    }
