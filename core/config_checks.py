"""Checks for config dataclass fields, run in `__post_init__` so a bad value fails before any work.

Public names: `check_fields`, `positive_int`, `non_negative_int`, `finite_positive`,
`finite_non_negative`, `fraction`, `optional`.

Each message names the command-line flag, the value, what was expected and the fix; tyro prints it
in one box when the value came from a flag. NaN and infinities are refused wherever a float is.

Example:
    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class Loop:
    ...     steps: int = 10
    ...     def __post_init__(self):
    ...         check_fields(self, "loop.", steps=positive_int)
    >>> Loop(steps=-3)
    Traceback (most recent call last):
    ...
    ValueError: loop.steps=-3: expected an int >= 1. Pass --loop.steps with an int >= 1.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

__all__ = ["Check", "check_fields", "finite_non_negative", "finite_positive", "fraction", "non_negative_int",
           "optional", "positive_int"]


class Check(NamedTuple):
    """A predicate on a field's value and the words for what it accepts."""

    ok: Callable[[Any], bool]
    expected: str


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


positive_int = Check(lambda v: _int(v) and v >= 1, "an int >= 1")
non_negative_int = Check(lambda v: _int(v) and v >= 0, "an int >= 0")
finite_positive = Check(lambda v: _real(v) and v > 0, "a finite number > 0")
finite_non_negative = Check(lambda v: _real(v) and v >= 0, "a finite number >= 0")
fraction = Check(lambda v: _real(v) and 0 <= v < 1, "a number in [0, 1)")


def optional(check: Check) -> Check:
    """`check`, or None."""
    return Check(lambda v: v is None or check.ok(v), f"{check.expected}, or None")


def check_fields(cfg: Any, flag_prefix: str = "", **checks: Optional[Check]) -> None:
    """Raise `ValueError` for the first field of `cfg` whose value its check refuses."""
    for name, check in checks.items():
        value = getattr(cfg, name)
        if check is not None and not check.ok(value):
            flag = f"{flag_prefix}{name}"
            raise ValueError(f"{flag}={value!r}: expected {check.expected}. Pass --{flag} with {check.expected}.")
