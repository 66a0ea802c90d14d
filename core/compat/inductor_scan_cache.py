"""Let Inductor's FX-graph cache keep a compiled step that holds torch's `scan`, as it keeps one without.

A patch (`WORKAROUNDS["scan_graph_cache"]`), on inside ember's own compiles. Inductor's FX-graph cache
bypasses every graph that holds a higher-order operator not marked cacheable ("Can't cache
HigherOrderOperator: scan", pytorch/pytorch#149318), so a rolled step compiled from scratch in every new
process: on an H200 (torch 2.11) the 125M step's first call took 62 s on a warm cache against
`torch.compile`'s 6.6 s. The key Inductor computes already holds the loop's body (the graph is pickled
with its subgraphs), so within `scan_graph_cache()` `scan` is marked cacheable through Inductor's own
opt-in, `unsafe_marked_cacheable_functions`, keyed by the torch release.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["scan_graph_cache"]


@contextlib.contextmanager
def scan_graph_cache() -> Iterator[None]:
    """Within the block, Inductor's FX-graph cache stores and loads graphs that hold `scan`."""
    try:
        from torch._higher_order_ops.scan import scan_op
        from torch._inductor import config

        marked = dict(config.unsafe_marked_cacheable_functions)
    except (AttributeError, ImportError):  # another torch's internals: Inductor's own behaviour
        yield
        return
    marked[f"{scan_op.__module__}.{scan_op.__name__}"] = torch.__version__
    with config.patch(unsafe_marked_cacheable_functions=marked):
        yield
