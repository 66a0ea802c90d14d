"""Skip loop reordering for a fused node that holds a foreach kernel, instead of failing the compile.

A patch (`WORKAROUNDS["foreach_loop_reordering"]`), on inside ember's own compiles on torch 2.9 to
2.11 (pytorch/pytorch#176591, fixed by #176849 in 2.12). On a GPU, Inductor tries to reorder a fused
node's loops so that it can fuse with a neighbour; `FusedSchedulerNode.reorder_loops_by_dep_pair`
asserts that every node inside is a `SchedulerNode`, which a foreach kernel (the optimizer's
`torch._foreach_*` update, fused with its producers) is not. On an H200 with torch 2.11 every
compiled `llama3_tiny` step failed there. Within `foreach_loop_reordering()` such a node is left
as it is (`False`: no reordering), which is what 2.12 on does; every other node reorders as before.
The CPU never reorders loops, so CPU compiles are unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

__all__ = ["foreach_loop_reordering"]


@contextlib.contextmanager
def foreach_loop_reordering() -> Iterator[None]:
    """Within the block, a fused node holding anything but plain scheduler nodes keeps its loops."""
    try:
        from torch._inductor.scheduler import FusedSchedulerNode, SchedulerNode

        reorder = FusedSchedulerNode.reorder_loops_by_dep_pair
    except (AttributeError, ImportError):  # another torch's internals: Inductor's own behaviour
        yield
        return

    def reorder_loops_by_dep_pair(self: Any, self_dep: Any, other_dep: Any) -> bool:
        if not all(isinstance(node, SchedulerNode) for node in self.snodes):
            return False
        return reorder(self, self_dep, other_dep)

    with mock.patch.object(FusedSchedulerNode, "reorder_loops_by_dep_pair", reorder_loops_by_dep_pair):
        yield
