"""A small named registry that fails loudly: duplicates raise, unknown names list the close ones.

Public names: `Registry`, `UnknownNameError`.

Every ember registry (model families and architectures, run configs, collators) is one of these,
so a user's package extends ember by decorating its own objects and `--import`ing itself.

Example:
    >>> reg = Registry("collator")
    >>> @reg.register("lm")
    ... def lm(batch): return batch
    >>> reg.get("lm") is lm
    True
    >>> try:
    ...     reg.get("ml")
    ... except KeyError as e:
    ...     print(str(e).split(" Known")[0])
    unknown collator 'ml'; did you mean 'lm'?
"""

from __future__ import annotations

import difflib
from typing import Callable, Dict, Generic, Iterator, List, TypeVar

__all__ = ["Registry", "UnknownNameError"]

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """An unknown registry name: a KeyError (a failed look-up) and a ValueError (a bad value),
    printed without the extra quoting KeyError adds."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    """Name -> object mapping with loud errors.

    Args:
        kind: what is registered, used in messages ("model family", "config", "collator").
        hint: how to make an unknown name known (appended to the error).
    """

    def __init__(self, kind: str, *, hint: str = "") -> None:
        self.kind = kind
        self.hint = hint or f"Register one with @{kind.replace(' ', '_')}(name) in a module you --import."
        self._items: Dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:
        """Register `obj` under `name`; a name registered twice raises ValueError."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} names must be non-empty strings, got {name!r}.")
        if name in self._items:
            raise ValueError(
                f"{self.kind} '{name}' is already registered (by {self._describe(self._items[name])}); "
                f"pick another name, or remove the first registration."
            )
        self._items[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`."""

        def deco(obj: T) -> T:
            return self.add(name, obj)

        return deco

    def get(self, name: str) -> T:
        """The object registered as `name`; unknown names raise KeyError with the closest matches."""
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        """The error text for an unknown `name` (close matches, known names, how to register)."""
        known = sorted(self._items)
        close = difflib.get_close_matches(str(name), known, n=3, cutoff=0.5)
        guess = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "."
        return f"unknown {self.kind} '{name}'{guess} Known: {known}. {self.hint}"

    def names(self) -> List[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def _describe(obj: object) -> str:
        mod = getattr(obj, "__module__", None)
        qual = getattr(obj, "__qualname__", None)
        return f"{mod}.{qual}" if mod and qual else repr(obj)
