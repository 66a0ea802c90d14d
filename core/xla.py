"""torch_xla helpers: virtual CPU devices, runtime start, graph cutting, compile counting.

Public names: `xla_cpu_devices`, `require_torch_xla`, `is_runtime_initialized`, `start_runtime`,
`autograd_guard`, `compile_count`, `sync`.

torch_xla is imported lazily, inside the functions that need it, so `import ember` works without
it. On CPU, torch_xla emulates `N` devices with `PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`; both are read
once, when the runtime starts (the first `torch_xla.device()` or XLA tensor), and cannot change
afterwards in the same process. Tests that need different device counts therefore run torch_xla
in subprocesses.

Backward order (pytorch/xla#4174, open; measured on torch 2.9 / torch_xla 2.9): autograd sizes its
per-device worker queues once, at the first backward pass of the process. A backward that ran
before the runtime started (a CPU reference, an earlier test) sizes them for 0 XLA devices, and
every later backward on XLA failed with `INTERNAL ASSERT FAILED ... device_ready_queues_`.
`start_runtime` probes this once per device and `autograd_guard` then runs XLA backward passes
on the calling thread (the public `torch.autograd.set_multithreading_enabled(False)`), which
works; `jit(backend="xla")` and `run_on_backends` do both, so the order no longer matters.

Example (a script that wants 4 virtual devices; skipped as a doctest because it sets env vars):
    >>> from ember.core import xla
    >>> xla.xla_cpu_devices(4)  # doctest: +SKIP
    >>> import torch_xla.runtime as xr  # doctest: +SKIP
    >>> xr.global_runtime_device_count()  # doctest: +SKIP
    4
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ContextManager, Dict, Optional, Sequence

import torch

from .compat import torch_xla as torch_xla_internals

__all__ = [
    "autograd_guard",
    "compile_count",
    "is_runtime_initialized",
    "require_torch_xla",
    "start_runtime",
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


# Device index -> whether autograd's worker queues cover it (fixed for the process once measured).
_autograd_covers: Dict[int, bool] = {}


def start_runtime(what: str = "backend='xla'") -> Any:
    """Start the torch_xla runtime (if needed) and make backward passes on its device work.

    Safe in any order: if a backward pass already ran before the runtime started, later XLA
    backward passes run under `autograd_guard` instead of failing (see the module docstring).

    Args:
        what: the feature that needs torch_xla, named in the error message if it is missing.

    Returns:
        `torch_xla.device()`.

    Raises:
        ImportError: torch_xla is not installed.
    """
    device = require_torch_xla(what).device()
    _autograd_probe(device)
    return device


def _autograd_probe(device: torch.device) -> bool:
    """Whether backward on `device` needs no guard; measured once per device index.

    The probe is a one-element lazy graph that is never compiled or run. If it is the process's
    first backward, it sizes autograd's queues for the XLA devices (the plain fix). A probe that
    fails with worker threads and on the calling thread alike is not this trap: no guard, and the
    step's own backward reports the error.
    """
    index = device.index or 0
    if index not in _autograd_covers:
        _autograd_covers[index] = _backward_works(device) or not _backward_works(device, threads=False)
    return _autograd_covers[index]


def _backward_works(device: torch.device, threads: bool = True) -> bool:
    try:  # grad on whatever the caller's mode: the probe measures the engine, not the context
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autograd.set_multithreading_enabled(threads):
            x = torch.ones((), device=device, requires_grad=True)
            torch.autograd.grad(x * 2.0, x)
    except RuntimeError:
        return False
    return True


def autograd_guard(device: torch.device) -> ContextManager:
    """A context in which backward passes on the XLA `device` work, whatever ran before.

    A no-op when autograd's worker queues cover the device (the runtime started before the first
    backward); otherwise backward runs on the calling thread
    (`torch.autograd.set_multithreading_enabled(False)`), the same result without a worker thread.
    """
    if _autograd_probe(device):
        return contextlib.nullcontext()
    return torch.autograd.set_multithreading_enabled(False)


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
