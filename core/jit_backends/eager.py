"""`jit(backend="eager")`: the entry called as is, with the same donation semantics (for debugging)."""

from __future__ import annotations

from typing import Any, Callable, Tuple

__all__ = ["EagerBackend"]


class EagerBackend:
    compile_count = 0

    def __init__(self, entry: Callable[..., Tuple[Any, bool]]) -> None:
        self._entry = entry

    def __call__(self, args: tuple, kwargs: dict) -> Tuple[Any, bool]:
        return self._entry(*args, **kwargs)
