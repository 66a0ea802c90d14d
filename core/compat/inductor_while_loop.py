"""Realize the copies Inductor makes of a loop's aliased carries, instead of failing the compile.

A patch (`WORKAROUNDS["while_loop_aliased_carries"]`), on inside ember's own compiles on torch 2.9
(fixed by pytorch/pytorch#164955 in 2.10). Inductor lowers a `scan` node to a `while_loop` whose
carried inputs must be distinct buffers. Where two are one buffer (a carry whose leaves start as one
tensor: `_distinct`'s copy is a no-op clone Inductor removes) it copies the second with a clone it
leaves unrealized, then reads that clone's strides: `NotImplementedError: Pointwise`. Within
`while_loop_aliased_carries()` the copy is realized (`ExternKernel.copy_input`), as 2.10 on does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Sequence
from unittest import mock

__all__ = ["while_loop_aliased_carries"]


@contextlib.contextmanager
def while_loop_aliased_carries() -> Iterator[None]:
    """Within the block, a `while_loop`'s carried input that aliases an earlier one is a realized copy."""
    try:
        from torch._inductor.ir import ExternKernel, ReinterpretView, WhileLoop

        WhileLoop._clone_aliased_inputs  # noqa: B018 (the method this replaces)
    except (AttributeError, ImportError):  # another torch's internals: Inductor's own behaviour
        yield
        return

    def _clone_aliased_inputs(carried_inputs: Sequence[Any]) -> List[Any]:
        seen: set = set()
        out = []
        for carried in carried_inputs:
            buffer = carried.unwrap_view() if isinstance(carried, ReinterpretView) else carried
            out.append(ExternKernel.copy_input(carried) if id(buffer) in seen else carried)
            seen.add(id(buffer))
        return out

    with mock.patch.object(WhileLoop, "_clone_aliased_inputs", staticmethod(_clone_aliased_inputs)):
        yield
