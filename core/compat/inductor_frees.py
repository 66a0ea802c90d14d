"""Free an Inductor buffer after its last read, not after the last write into a donated input.

A patch (`WORKAROUNDS["frees_after_last_read"]`), on inside ember's own compiles on torch 2.9 only:
torch 2.13 to 2.15's schedulers already free these buffers after their last read (measured by its
test). A donated step ends by copying the new params and optimizer state into its inputs. Inductor orders
every such in-place write after all earlier reads of that input with a `WeakDep` from the writing
node to the *outputs* of each reading node, and torch 2.9's `Scheduler.compute_last_usage` counts
those `WeakDep`s as uses: every buffer computed by a node that reads a parameter (each matmul's
output, each norm's output) then stays allocated until the optimizer has written that parameter, at
the very end of the step. Transient memory at peak of a donated Llama step against
`torch.compile(module)` + fused AdamW (`launch/bench.py --memory`, BENCHMARKS.md): 125M 1.90x before
this, 1.10x with it; tiny 1.34x before, 1.11x with it.

Within `frees_after_last_read()`, a scheduler node's used buffers leave out the names it reaches
only through a `WeakDep`. The dependency itself stays, so the write still runs after the reads; only
the `del` of the reader's output moves back to its real last use. The block also adds a tag to
`torch.compiler.config.cache_key_tag` (part of every compile cache key), so a graph compiled with
Inductor's own lifetimes is never loaded from the disk cache in place of this one, nor the other way
round.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator
from unittest import mock

import torch

__all__ = ["frees_after_last_read"]

_CACHE_TAG = "ember-frees-after-last-read-1"


@contextlib.contextmanager
def frees_after_last_read() -> Iterator[None]:
    """Within the block, Inductor frees each buffer after its last real use (see the module doc)."""
    try:
        from torch._inductor.dependencies import WeakDep
        from torch._inductor.scheduler import BaseSchedulerNode

        counted = BaseSchedulerNode.used_or_aliased_buffer_names
    except (AttributeError, ImportError):  # another torch's internals: Inductor's own lifetimes
        yield
        return

    def used_or_aliased_buffer_names(self: Any) -> Any:
        names = counted(self)
        deps = list(itertools.chain(self.read_writes.reads, self.read_writes.writes))
        weak_only = {d.name for d in deps if isinstance(d, WeakDep)} - {
            d.name for d in deps if not isinstance(d, WeakDep)
        }
        if not weak_only:
            return names
        return type(names)(n for n in names if n not in weak_only)

    tag = "+".join(filter(None, (torch.compiler.config.cache_key_tag, _CACHE_TAG)))
    with mock.patch.object(BaseSchedulerNode, "used_or_aliased_buffer_names", used_or_aliased_buffer_names), \
            torch.compiler.config.patch(cache_key_tag=tag):
        yield
