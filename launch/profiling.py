"""Profiling a run: a torch.profiler trace of chosen steps and a memory snapshot.

Public names: `ProfileConfig`.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ProfileConfig"]


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """`--profile.steps A:B` traces steps A to B (Chrome / Perfetto trace under out/profile); `--profile.memory` a memory snapshot."""

    steps: str = ""
    """Steps to trace, `A:B` (both included); "": none."""
    memory: bool = False
    """Also record memory: a CUDA memory snapshot on a GPU; on the CPU, what the allocator reports."""
