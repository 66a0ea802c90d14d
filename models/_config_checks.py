"""Config validation helpers shared by the model families: messages name the field and the fix."""

from __future__ import annotations

from typing import Any, Sequence


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_positive(cfg: Any, *names: str) -> None:
    """Each field in `names` must be a positive int."""
    cls = type(cfg).__name__
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{cls}.{name} must be an int, got {type(v).__name__} {v!r}.")
        if v <= 0:
            raise ValueError(f"{cls}.{name} must be positive, got {v}.")


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
