"""`define_once`: ember's custom ops are defined once per process, even if ember is imported twice.

Public names: none (used by `remat_barrier.py`).

pytest imports the repository root under its folder name as well as `ember`, so a module can run
twice. A second `torch.library.custom_op` of the same name replaces the first registration and
leaves the first copy's op pointing at nothing ("Tried to access the schema for ."), so which copy
imported last decided whether remat worked. Every copy gets what the first definition returned.
"""

from __future__ import annotations

from typing import Callable, Dict, TypeVar

import torch

__all__: list = []

T = TypeVar("T")


def define_once(name: str, define: Callable[[], T]) -> T:
    """`define()` the first time `name` is asked for in this process; after that, what it returned."""
    namespace = torch.ops.ember
    defined: Dict[str, object] = getattr(namespace, "_ember_defined", None) or {}
    namespace._ember_defined = defined
    if name not in defined:
        defined[name] = define()
    return defined[name]  # type: ignore[return-value]
