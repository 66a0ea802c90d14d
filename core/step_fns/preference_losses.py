"""Preference losses over sequence log-probabilities: DPO and its variants, with TRL's names.

Public names: `preference_losses`, `PreferenceLosses`, `sft_loss`, `check_loss_type`, `PREFERENCE_LOSSES`,
`REFERENCE_FREE`.

Every loss is a pure function of the policy's (and, where it has one, the reference's) summed
log-probabilities of the chosen and rejected responses, one value per pair. With
`delta = (chosen - ref_chosen) - (rejected - ref_rejected)` and `eps = label_smoothing`:

    sigmoid   -(1 - eps) log s(beta delta) - eps log s(-beta delta)       DPO; eps > 0: conservative DPO
    hinge     relu(1 - beta delta)                                         SLiC
    ipo       (delta_per_token - 1 / (2 beta))^2                           IPO, log-ratios over response length
    robust    (-(1 - eps) log s(beta delta) + eps log s(-beta delta)) / (1 - 2 eps)   rDPO
    simpo     -(1 - eps) log s(beta m - gamma) - eps log s(-(beta m - gamma)) m: mean log-prob margin, no reference
    orpo      -beta log s(log odds(chosen) - log odds(rejected))           odds of the mean log-probs, no reference

(`s` the logistic function.) Rewards are `beta * (logps - ref_logps)`, or `beta * mean logps` for the
reference-free losses, as TRL's DPO and CPO / ORPO trainers log them. An SFT term (RPO, ORPO's NLL)
is the chosen responses' mean negative log-likelihood per token, `sft_loss`.
"""

from __future__ import annotations

import difflib
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .sequence_logps import SequenceLogps

__all__ = ["PREFERENCE_LOSSES", "PreferenceLosses", "REFERENCE_FREE", "check_loss_type", "preference_losses",
           "sft_loss"]

PREFERENCE_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
"""The losses that read no reference model."""


class PreferenceLosses(NamedTuple):
    """Per pair: the loss and the chosen and rejected rewards (detached)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def check_loss_type(loss_type: str, *, where: str = "preference_losses(loss_type=...)") -> None:
    """One line naming the known losses (and the nearest) when `loss_type` is not one of them."""
    if loss_type not in PREFERENCE_LOSSES:
        near = difflib.get_close_matches(str(loss_type), PREFERENCE_LOSSES, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"{where}: unknown preference loss {loss_type!r}; expected one of "
                         f"{', '.join(PREFERENCE_LOSSES)}.{hint}")


def preference_losses(chosen: SequenceLogps, rejected: SequenceLogps, ref_chosen: Optional[Tensor] = None,
                      ref_rejected: Optional[Tensor] = None, *, loss_type: str = "sigmoid", beta: float = 0.1,
                      label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> PreferenceLosses:
    """The per-pair loss `loss_type` (see the module docstring) and the rewards TRL logs.

    Args:
        chosen, rejected: the policy's summed log-probabilities and response token counts, `(P,)`.
        ref_chosen, ref_rejected: the reference's summed log-probabilities `(P,)`; None for the
            reference-free losses (`simpo`, `orpo`).
        loss_type: one of `PREFERENCE_LOSSES`.
        beta: the inverse temperature (ORPO's lambda for `orpo`).
        label_smoothing: the probability that a pair's label is flipped (`sigmoid`, `robust`, `simpo`).
        simpo_gamma: SimPO's target reward margin.

    Example:
        >>> import torch
        >>> lp = lambda *v: SequenceLogps(torch.tensor(v), torch.tensor([2, 2]))
        >>> out = preference_losses(lp(-1.0, -3.0), lp(-2.0, -2.0), torch.tensor([-1.5, -2.5]),
        ...                         torch.tensor([-1.5, -2.5]), beta=0.5)
        >>> [round(x, 4) for x in out.losses.tolist()], out.chosen_rewards.tolist()
        ([0.4741, 0.9741], [0.25, -0.25])
    """
    check_loss_type(loss_type)
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"preference_losses(loss_type='robust') needs 0 <= label_smoothing < 0.5, got {label_smoothing}.")
    if loss_type in REFERENCE_FREE:
        return _reference_free(chosen, rejected, loss_type, beta, label_smoothing, simpo_gamma)
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"preference_losses(loss_type={loss_type!r}) compares the policy with a reference: pass "
                         f"ref_chosen and ref_rejected, or use a reference-free loss ({', '.join(REFERENCE_FREE)}).")
    chosen_ratio = chosen.total - ref_chosen.to(chosen.total.dtype)
    rejected_ratio = rejected.total - ref_rejected.to(rejected.total.dtype)
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = _smoothed_logistic(beta * delta, label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":  # TRL's: the log-ratios per response token (as the IPO authors ran it)
        per_token = chosen_ratio / _tokens(chosen) - rejected_ratio / _tokens(rejected)
        losses = (per_token - 1 / (2 * beta)) ** 2
    else:  # robust
        clean = -(1 - label_smoothing) * _log_sigmoid(beta * delta)
        flipped = label_smoothing * _log_sigmoid(-beta * delta)
        losses = (clean + flipped) / (1 - 2 * label_smoothing)
    return PreferenceLosses(losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach())


def sft_loss(chosen: SequenceLogps) -> Tensor:
    """The chosen responses' negative log-likelihood per token over the batch (RPO's and ORPO's SFT term)."""
    return -chosen.total.sum() / chosen.count.sum().to(chosen.total.dtype).clamp(min=1.0)


def _reference_free(chosen: SequenceLogps, rejected: SequenceLogps, loss_type: str, beta: float,
                    label_smoothing: float, simpo_gamma: float) -> PreferenceLosses:
    mean_chosen, mean_rejected = chosen.mean(), rejected.mean()
    if loss_type == "simpo":
        losses = _smoothed_logistic(beta * (mean_chosen - mean_rejected) - simpo_gamma, label_smoothing)
    else:  # orpo: log odds = log p - log(1 - p) of the mean log-probabilities
        log_odds = (mean_chosen - mean_rejected) - (_log1mexp(mean_chosen) - _log1mexp(mean_rejected))
        losses = -beta * _log_sigmoid(log_odds)
    return PreferenceLosses(losses, (beta * mean_chosen).detach(), (beta * mean_rejected).detach())


def _smoothed_logistic(logits: Tensor, label_smoothing: float) -> Tensor:
    losses = -_log_sigmoid(logits)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * _log_sigmoid(-logits)
    return losses


def _log_sigmoid(x: Tensor) -> Tensor:
    """`log(sigmoid(x)) = -log1p(exp(-x))`, its gradient `sigmoid(-x)` exact at 0 (an `abs` or `relu` form's is 0
    there, and DPO's first step, the policy equal to its reference, sits at 0); below -30 it is `x` (within
    1e-13). Plain ops whose backward DTensor shards on torch 2.9-2.15 (it has no `log_sigmoid_backward` rule)."""
    return torch.where(x < -30.0, x, -torch.log1p(torch.exp(-x.clamp(min=-40.0))))  # the clamp: no inf in exp


def _tokens(logps: SequenceLogps) -> Tensor:
    return logps.count.to(logps.total.dtype).clamp(min=1.0)


def _log1mexp(x: Tensor) -> Tensor:
    """`log(1 - exp(x))` for x < 0, accurate near 0 and far from it."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
