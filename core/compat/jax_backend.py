"""Whether JAX already started a backend in this process (WORKAROUNDS entry `jax_backend_state`).

`jax.distributed.initialize` must run before JAX starts any backend, and JAX has no public way to
ask whether one started; orbax imports JAX, so ember checks before a multi-process checkpoint.
"""

from __future__ import annotations

__all__ = ["jax_backends_started"]


def jax_backends_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())
