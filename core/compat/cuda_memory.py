"""The CUDA allocator's event history and its snapshot, for `--profile.memory` (torch's documented workflow).

torch documents memory snapshots (https://pytorch.org/docs/stable/torch_cuda_memory.html) through
`torch.cuda.memory._record_memory_history` and `_dump_snapshot`, still private on 2.9-2.15
(pytorch/pytorch#97406 made them the recording API; no public name since).
"""

from __future__ import annotations

import torch

__all__ = ["dump_memory_snapshot", "record_memory_history", "stop_memory_history"]


def record_memory_history(*, max_entries: int) -> None:
    """Start recording every CUDA allocation and free (the last `max_entries` kept), with Python stacks."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded history as a pickle that https://pytorch.org/memory_viz opens."""
    torch.cuda.memory._dump_snapshot(path)


def stop_memory_history() -> None:
    """Stop recording (the history is dropped)."""
    torch.cuda.memory._record_memory_history(enabled=None)
