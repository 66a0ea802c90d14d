"""torch_xla helpers: virtual CPU devices, graph cutting, compile counting.

Public names: `xla_cpu_devices`, `require_torch_xla`, `is_runtime_initialized`, `compile_count`,
`sync`.

torch_xla is imported lazily, inside the functions that need it, so `import ember` works without
it. On CPU, torch_xla emulates `N` devices with `PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`; both are read
once, when the runtime starts (the first `torch_xla.device()` or XLA tensor), and cannot change
afterwards in the same process. Tests that need different device counts therefore run torch_xla
in subprocesses.

Example (a script that wants 4 virtual devices; skipped as a doctest because it sets env vars):
    >>> from ember.core import xla
    >>> xla.xla_cpu_devices(4)  # doctest: +SKIP
    >>> import torch_xla.runtime as xr  # doctest: +SKIP
    >>> xr.global_runtime_device_count()  # doctest: +SKIP
    4
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from .compat import torch_xla as torch_xla_internals

__all__ = [
    "compile_count",
    "is_runtime_initialized",
    "require_torch_xla",
    "sync",
    "xla_cpu_devices",
]

_MSG_NO_TORCH_XLA = (
    "{what} needs torch_xla, which is not importable here ({err}). Install it in its own "
    "environment with `pip install \"ember[xla]\"` (from a checkout: `make install-xla`, which "
    "makes .venv-xla): torch_xla 2.9.0 has wheels for Linux x86-64 only and brings torch 2.9.0 "
    "exactly. Without it, use backend='inductor' or backend='eager'."
)

_MSG_ALREADY_INITIALIZED = (
    "xla_cpu_devices({n}) was called after the torch_xla runtime started with PJRT_DEVICE={dev} "
    "and {have} device(s); the device type and count are fixed when the runtime starts (the first "
    "torch_xla.device() or XLA tensor) and cannot change in this process. Call xla_cpu_devices({n}) "
    "before anything touches an XLA device, or run the code that needs {n} devices in a fresh "
    "process (e.g. subprocess with env PJRT_DEVICE=CPU CPU_NUM_DEVICES={n})."
)


def require_torch_xla(what: str = "backend='xla'") -> Any:
    """Import and return the `torch_xla` module, or raise an `ImportError` that says how to get it.

    Args:
        what: the feature that needs torch_xla, named in the error message.

    Returns:
        The `torch_xla` module.

    Raises:
        ImportError: torch_xla is not installed (or fails to import).
    """
    try:
        import torch_xla
        import torch_xla.debug.metrics  # noqa: F401  (compile_count reads it)
    except ImportError as err:  # pragma: no cover - exercised only where torch_xla is missing
        raise ImportError(_MSG_NO_TORCH_XLA.format(what=what, err=err)) from err
    return torch_xla


def is_runtime_initialized() -> bool:
    """True if the torch_xla runtime (PJRT client) has started in this process.

    Never imports torch_xla: if it was not imported, the runtime cannot have started.
    """
    return torch_xla_internals.runtime_is_initialized()


def xla_cpu_devices(n: int) -> None:
    """Ask torch_xla for `n` virtual CPU devices (sets `PJRT_DEVICE=CPU`, `CPU_NUM_DEVICES=n`).

    Must run before the torch_xla runtime starts. If it already started with the same device type
    and count this is a no-op; otherwise it raises instead of silently leaving the old count.

    Args:
        n: number of virtual CPU devices, at least 1.

    Raises:
        TypeError: `n` is not an int.
        ValueError: `n < 1`.
        RuntimeError: the torch_xla runtime already started with another device type or count.

    Example:
        >>> from ember.core.xla import xla_cpu_devices
        >>> xla_cpu_devices(8)  # doctest: +SKIP  (then a mesh "dp=2,tp=4" fits)
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"xla_cpu_devices(n) expects an int device count, got {type(n).__name__} {n!r}.")
    if n < 1:
        raise ValueError(f"xla_cpu_devices(n) expects n >= 1 virtual devices, got {n}.")
    if is_runtime_initialized():
        import torch_xla.runtime as xr

        dev = (xr.device_type() or "").upper()
        have = xr.global_runtime_device_count()
        if dev != "CPU" or have != n:
            raise RuntimeError(_MSG_ALREADY_INITIALIZED.format(n=n, dev=dev or "<unset>", have=have))
        return
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(n)


def compile_count() -> int:
    """How many XLA graphs this process has compiled so far (torch_xla counter `UncachedCompile`).

    A graph whose hash is already in torch_xla's in-memory cache counts as `CachedCompile` instead
    and is not included.
    """
    require_torch_xla("compile_count()")
    import torch_xla.debug.metrics as met

    return int(met.counter_value("UncachedCompile") or 0)


def sync(tensors: Optional[Sequence[Any]] = None, *, wait: bool = False) -> None:
    """Cut the pending lazy graph and launch it; `wait=True` blocks until it has run.

    Args:
        tensors: if given, materialise exactly these XLA tensors (one graph whose outputs are
            these tensors, whatever else is pending); otherwise everything pending
            (`torch_xla.sync()`, which also runs step closures).
        wait: block until the device finished.
    """
    torch_xla = require_torch_xla("sync()")
    if tensors is None:
        torch_xla.sync(wait=wait)
    else:
        torch_xla_internals.sync_tensors(tensors, wait=wait)
