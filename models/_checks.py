"""Checks shared by the model families: config fields (messages name the field and the fix) and inputs.

`check_tokens` looks at shapes and dtypes only, so it is safe under tracing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def check_tokens(tokens: Tensor, *, max_seq_len: int, field: str) -> None:
    """Raise unless `tokens` is a (B, T) integer tensor with T <= max_seq_len.

    Args:
        tokens: the model input.
        max_seq_len: the configured limit.
        field: the config field holding the limit, e.g. "Llama3Config.max_seq_len".
    """
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokens must be a (B, T) integer tensor, got {type(tokens).__name__}.")
    if tokens.dtype not in _INT_DTYPES:
        raise TypeError(
            f"tokens must be integer token ids (int64 or int32), got dtype {tokens.dtype}. "
            f"Convert with tokens.long()."
        )
    if tokens.dim() != 2:
        raise ValueError(
            f"tokens must have shape (B, T), got {tuple(tokens.shape)}. Add a batch dimension with "
            f"tokens[None] for a single sequence."
        )
    if tokens.shape[1] > max_seq_len:
        raise ValueError(
            f"sequence length {tokens.shape[1]} exceeds {field}={max_seq_len}. Shorten the inputs "
            f"or build the model with a larger max_seq_len (e.g. .replace(max_seq_len="
            f"{tokens.shape[1]}) on the config)."
        )


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_positive(cfg: Any, *names: str) -> None:
    """Each field in `names` must be a positive int."""
    _check_ints(cfg, names, minimum=1, what="positive")


def check_non_negative(cfg: Any, *names: str) -> None:
    """Each field in `names` must be an int >= 0 (0 meaning off)."""
    _check_ints(cfg, names, minimum=0, what=">= 0 (0 turns it off)")


def _check_ints(cfg: Any, names: Sequence[str], *, minimum: int, what: str) -> None:
    cls = type(cfg).__name__
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{cls}.{name} must be an int, got {type(v).__name__} {v!r}.")
        if v < minimum:
            raise ValueError(f"{cls}.{name} must be {what}, got {v}.")


def check_divides(cfg: Any, small: str, big: str, *, why: str) -> None:
    """`getattr(cfg, small)` must divide `getattr(cfg, big)`; the message lists valid choices."""
    cls = type(cfg).__name__
    s, b = getattr(cfg, small), getattr(cfg, big)
    if b % s:
        raise ValueError(
            f"{cls}.{small}={s} does not divide {cls}.{big}={b} ({b} / {s} = {b / s:.4g}); {why}. "
            f"Choose {small} among the divisors of {big}: {_divisors(b)}."
        )


def check_range(cfg: Any, name: str, lo: float, hi: float, *, hi_inclusive: bool = False) -> None:
    """`lo <= value < hi` (or `<= hi`)."""
    v = getattr(cfg, name)
    ok = lo <= v <= hi if hi_inclusive else lo <= v < hi
    if not ok:
        close = "]" if hi_inclusive else ")"
        raise ValueError(f"{type(cfg).__name__}.{name} must be in [{lo}, {hi}{close}, got {v}.")


def check_choice(cfg: Any, name: str, choices: Sequence[str]) -> None:
    """A string field must be one of `choices`."""
    v = getattr(cfg, name)
    if v not in choices:
        raise ValueError(f"{type(cfg).__name__}.{name} must be one of {list(choices)}, got {v!r}.")


def check_remat(cfg: Any, name: str) -> None:
    """A remat policy name (`ember.core.remat_policies`); `True` / `False` (older configs) become "full" / "none"."""
    from ..core.remat_policies import remat_policy

    value = getattr(cfg, name)
    if isinstance(value, bool):
        object.__setattr__(cfg, name, "full" if value else "none")
        return
    try:
        remat_policy(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{type(cfg).__name__}.{name}: {err}") from None
