"""Transpose a C++ kernel's tile only where its address is known before the tile's loop.

A patch (`WORKAROUNDS["cpp_transpose_indirect_index"]`), on inside ember's own CPU compiles on the
releases in its range (fixed upstream by pytorch/pytorch#178962). Inductor's C++ backend loads a
transposed tile before the kernel's inner loop; where the tile's address holds an indirect index (a
value the loop loads first: a stacked leaf's slice at a loop's index, then transposed, as a rolled
layer reads its weights) the load names a variable declared only inside that loop, and g++ fails
the whole step ("'tmp5' was not declared in this scope"; plain torch:
`torch.compile(lambda x, i: (x.index_select(0, i)[0].mT * 2).contiguous())`). Within
`transposed_tiles_of_direct_indices()` such a load stays a plain vector load, as upstream's fix does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

__all__ = ["transposed_tiles_of_direct_indices"]


@contextlib.contextmanager
def transposed_tiles_of_direct_indices() -> Iterator[None]:
    """Within the block, Inductor's C++ kernels transpose no tile whose address holds a loaded index."""
    try:
        from torch._inductor.codegen.cpp import CppTile2DKernel
        from torch.utils._sympy.symbol import SymT, free_symbol_is_type

        need_vec_transpose = CppTile2DKernel.need_vec_transpose
    except (AttributeError, ImportError):  # another torch's internals: Inductor's own behaviour
        yield
        return

    def direct_only(self, index):  # type: ignore[no-untyped-def]
        return not free_symbol_is_type(index, SymT.TMP) and need_vec_transpose(self, index)

    with mock.patch.object(CppTile2DKernel, "need_vec_transpose", direct_only):
        yield
