"""Loss functions for pure steps: token cross-entropy with ignored positions and z-loss.

Public names: `cross_entropy`.

Every loss computes in float32 (or float64 for float64 logits) whatever the logits' dtype, reduces without Python branching on
tensor values (so it traces whole under `torch.compile(fullgraph=True)` and torch_xla), and
returns 0 rather than NaN when every position is ignored.
"""

from __future__ import annotations

from typing import Dict, Literal, Tuple, Union

import torch
from torch import Tensor

from .token_loss import TokenLoss

__all__ = ["cross_entropy"]

Reduction = Literal["mean", "sum", "none", "sum_and_count"]
_REDUCTIONS = ("mean", "sum", "none", "sum_and_count")


def _check_inputs(logits: Tensor, labels: Tensor, reduction: str) -> None:
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        got = f"tensor of dtype {logits.dtype}" if isinstance(logits, Tensor) else type(logits).__name__
        raise TypeError(f"cross_entropy: `logits` must be a floating-point tensor (..., V), got {got}.")
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.is_complex():
        got = f"tensor of dtype {labels.dtype}" if isinstance(labels, Tensor) else type(labels).__name__
        raise TypeError(
            f"cross_entropy: `labels` must be an integer tensor of class indices (...), got {got}. "
            f"For soft targets use torch.nn.functional.cross_entropy with probabilities."
        )
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"cross_entropy: `logits` must have shape labels.shape + (V,); got logits "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)}. For (B, V, T) logits, "
            f"move the class dim last: logits.transpose(1, -1)."
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"cross_entropy: reduction must be one of {list(_REDUCTIONS)}, got {reduction!r}."
        )


def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: Reduction = "mean",
    return_aux: bool = False,
) -> Union[Tensor, TokenLoss, Tuple[Union[Tensor, TokenLoss], Dict[str, Tensor]]]:
    """Softmax cross-entropy over the last axis, with ignored labels and an optional z-loss.

    The per-token loss is `logsumexp(logits) - logits[label]`, computed in float32 (bf16/fp16
    logits are upcast; float64 logits stay float64, e.g. for finite-difference checks). Positions
    whose label equals `ignore_index` contribute nothing; `"mean"` divides by the number of
    non-ignored positions (0 of them gives a loss of 0, not NaN). The z-loss adds
    `z_loss * logsumexp(logits)**2` per non-ignored token, reduced the same way, which keeps the
    softmax normaliser near 1 (PaLM, Chowdhery et al. 2022, sec. 5, uses `z_loss=1e-4`).

    Args:
        logits: `(..., V)` floating tensor of unnormalised scores (any float dtype).
        labels: `(...)` integer tensor of class indices in `[0, V)`, or `ignore_index`.
        ignore_index: label value that marks a position to skip (padding, prompt tokens).
        z_loss: weight of the z-loss term; `0.0` skips computing it.
        reduction: `"mean"` over non-ignored positions (a 0-d tensor), `"sum"` (0-d),
            `"none"` (the per-position loss, shape `(...)`, 0 at ignored positions), or
            `"sum_and_count"`: a `TokenLoss(sum, count)` that `train_step` weights by tokens
            across microbatches and data-parallel ranks.
        return_aux: also return a dict with `"ce_loss"` (the cross-entropy part), `"z_loss"`
            (the weighted z-loss part, already included in the loss) and `"num_tokens"` (0-d
            int64 count of non-ignored positions), each reduced like the loss except
            `num_tokens` (`"sum_and_count"` gives the parts as means).

    Returns:
        The float32 (float64 for float64 logits) loss (0-d, `(...)` for `reduction="none"`, a
        `TokenLoss` for `"sum_and_count"`); with `return_aux=True`, the tuple `(loss, aux)`.

    Raises:
        TypeError: `logits` is not floating point or `labels` is not an integer tensor.
        ValueError: shapes do not match (`logits.shape[:-1] != labels.shape`) or `reduction`
            is not one of `"mean"`, `"sum"`, `"none"`.

    Example:
        >>> import torch
        >>> from ember.core.step_fns import cross_entropy
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [5.0, 5.0]])  # (3, V=2)
        >>> labels = torch.tensor([0, 0, -100])                          # last one ignored
        >>> round(cross_entropy(logits, labels).item(), 4)
        1.1269
        >>> cross_entropy(logits, torch.full((3,), -100)).item()         # all ignored: 0, not NaN
        0.0
        >>> loss, aux = cross_entropy(logits, labels, z_loss=1e-4, return_aux=True)
        >>> int(aux["num_tokens"]), round(aux["z_loss"].item(), 6)
        (2, 0.000452)
    """
    _check_inputs(logits, labels, reduction)
    work = torch.promote_types(logits.dtype, torch.float32)
    logits32 = logits.to(work)  # (..., V) float32 (float64 stays float64)
    lse = torch.logsumexp(logits32, dim=-1)  # (...)
    valid = labels != ignore_index  # (...) bool
    # Ignored positions read class 0 so the gather stays in range; their loss is masked below.
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels)).long()  # (...)
    label_logit = torch.gather(logits32, -1, safe_labels.unsqueeze(-1)).squeeze(-1)  # (...)
    zero = torch.zeros((), dtype=work, device=logits.device)
    ce = torch.where(valid, lse - label_logit, zero)  # (...)
    z = torch.where(valid, lse.square(), zero) * z_loss if _has_z_loss(z_loss) else None
    num_tokens = valid.sum()  # 0-d int64

    if reduction == "none":
        ce_red, z_red = ce, z
    elif reduction == "sum":
        ce_red, z_red = ce.sum(), (z.sum() if z is not None else None)
    else:
        # clamp keeps an all-ignored batch at 0 / 1 = 0 instead of 0 / 0 = NaN.
        denom = num_tokens.clamp(min=1).to(work)
        ce_red, z_red = ce.sum() / denom, (z.sum() / denom if z is not None else None)
    loss = ce_red if z_red is None else ce_red + z_red
    if reduction == "sum_and_count":
        loss = TokenLoss(ce.sum() + z.sum() if z is not None else ce.sum(), num_tokens)
    if not return_aux:
        return loss
    aux = {
        "ce_loss": ce_red,
        "z_loss": z_red if z_red is not None else torch.zeros_like(ce_red),
        "num_tokens": num_tokens,
    }
    return loss, aux


def _has_z_loss(z_loss: float | Tensor) -> bool:
    # A tensor weight (e.g. a scheduled hyperparameter) is always applied; a Python 0.0 is skipped.
    return isinstance(z_loss, Tensor) or z_loss != 0.0
