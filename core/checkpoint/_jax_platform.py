"""Keep JAX on the CPU: ember uses it only for orbax's host-memory arrays, the accelerator is torch's.

Name: `keep_jax_on_cpu`, called by `CheckpointManager` before it imports orbax (and by multi-process setup).

Imported with CUDA support, JAX would take the GPU at its first use (and preallocate 75% of its
memory before torch's first step). `keep_jax_on_cpu()` runs before orbax is imported and before any
JAX backend starts: it sets `JAX_PLATFORMS=cpu` (for this process and the ones it starts) and, when
JAX is already imported (grain imports it), `jax.config.update("jax_platforms", "cpu")`. A user who
chose JAX's platforms (the `JAX_PLATFORMS` variable, or `jax_platforms` in `jax.config`) keeps them.
"""

from __future__ import annotations

import os
import sys

__all__ = ["keep_jax_on_cpu"]


def keep_jax_on_cpu() -> None:
    """Pin JAX to the CPU unless the user chose its platforms or a JAX backend already runs."""
    if os.environ.get("JAX_PLATFORMS"):
        return  # the user's choice (or ours, made earlier in this process)
    jax = sys.modules.get("jax")
    if jax is not None:
        from ..compat.jax_backend import jax_backends_started

        if jax.config.jax_platforms or jax_backends_started():
            return  # chosen in code, or too late to change: JAX keeps what it has
        jax.config.update("jax_platforms", "cpu")
    os.environ["JAX_PLATFORMS"] = "cpu"
