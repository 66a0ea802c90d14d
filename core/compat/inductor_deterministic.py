"""Inductor's own deterministic mode, kept as the user set it across ember's deterministic scopes.

From torch 2.10 (pytorch/pytorch#165950) `torch.use_deterministic_algorithms(mode)` also writes
`mode` into the private `torch._inductor.config.deterministic` (no autotuning or padding benchmarks
that change numerics). Restoring the user's deterministic setting after a compiled call would then
overwrite an Inductor setting the user made themselves; `kept_inductor_deterministic` saves and
restores it around the block (WORKAROUNDS entry `inductor_deterministic`). Elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import gated_on

__all__ = ["inductor_deterministic", "kept_inductor_deterministic"]


def inductor_deterministic() -> object:
    """`torch._inductor.config.deterministic` (None where this torch has no such setting)."""
    from torch._inductor import config

    return getattr(config, "deterministic", None)


@contextlib.contextmanager
def kept_inductor_deterministic() -> Iterator[None]:
    """Inductor's deterministic setting as it was before the block, whatever the block set."""
    if not gated_on("inductor_deterministic"):
        yield
        return
    from torch._inductor import config

    before = config.deterministic
    try:
        yield
    finally:
        config.deterministic = before
