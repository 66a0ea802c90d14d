"""Collators: numpy batch dicts from the pipeline -> what the training step consumes.

Public names:
    Collator: the signature of a collator, `fn(batch, *, device=None) -> batch`.
    collator: decorator registering a collator under a name (`@collator("torch")`).
    get_collator: looks a collator up by name; unknown names list the known ones and the
        closest match.
    available_collators: the registered names, sorted.
    to_torch: numpy arrays -> torch tensors, zero-copy when the dtype already matches, pinned
        when CUDA is present, optionally moved to a device. Registered as "torch".
    identity_collate: returns the numpy batch unchanged. Registered as "numpy".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from ..core.registry import Registry

__all__ = ["Collator", "available_collators", "collator", "get_collator", "identity_collate", "to_torch"]


class Collator(Protocol):
    """A function from a numpy batch dict to the batch the step consumes."""

    def __call__(self, batch: Mapping[str, Any], *, device: torch.device | str | None = None) -> Any: ...


_COLLATORS: Registry[Collator] = Registry(
    "collator", hint="Register one with @ember.data.collator(name) in a module you --import."
)
_F = TypeVar("_F", bound=Callable[..., Any])


def collator(name: str) -> Callable[[_F], _F]:
    """Registers the decorated function as the collator `name`.

    Args:
        name: a unique name (used in configs, e.g. `data.collate="torch"`).

    Returns:
        The decorator; it returns the function unchanged.

    Raises:
        ValueError: if `name` is already registered (the message names the existing function).

    Example:
        >>> @collator("ids_only")  # doctest: +SKIP
        ... def ids_only(batch, *, device=None):
        ...     return to_torch({"inputs": batch["inputs"]}, device=device)
    """
    return _COLLATORS.register(name)


def available_collators() -> list[str]:
    """Returns the registered collator names, sorted."""
    return _COLLATORS.names()


def get_collator(name: str) -> Collator:
    """Returns the collator registered under `name`.

    Raises:
        ValueError: for an unknown name (also a KeyError); the message lists the closest match
            and the known names.

    Example:
        >>> get_collator("torch") is to_torch
        True
    """
    return _COLLATORS.get(name)


def _leaf_to_torch(x: Any, *, key: str, dtype: torch.dtype | None, pin: bool) -> Any:
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray):
        arr = x if x.flags.writeable else x.copy()  # torch.from_numpy warns on read-only arrays
        if type(arr) is not np.ndarray:
            arr = arr.view(np.ndarray)  # e.g. grain's SharedMemoryArray; the view keeps it alive
        t = torch.from_numpy(np.ascontiguousarray(arr))
    elif isinstance(x, (int, float, bool, np.generic)):
        t = torch.as_tensor(x)
    else:
        raise TypeError(f"batch[{key!r}] must be a numpy array, tensor or number, got {type(x).__name__}.")
    if dtype is not None and t.dtype != dtype and not t.is_floating_point():
        t = t.to(dtype)
    if pin and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t


@collator("torch")
def to_torch(
    batch: Mapping[str, Any],
    *,
    device: torch.device | str | None = None,
    int_dtype: torch.dtype | None = torch.int64,
    pin_memory: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Converts a numpy batch dict to torch tensors.

    Arrays become tensors with `torch.from_numpy` (sharing memory) when no dtype change is needed;
    the pipeline already yields int64 ids, so that is the usual case. Integer leaves are cast to
    `int_dtype`; float leaves keep their dtype.

    Args:
        batch: `{"inputs": (B, T) int, "targets": (B, T) int, ...}` numpy arrays (or tensors).
        device: move the tensors there (non-blocking from pinned memory); None keeps them on CPU.
        int_dtype: dtype for integer leaves (None keeps theirs).
        pin_memory: page-lock CPU tensors for fast async host-to-GPU copies; None means "when
            `torch.cuda.is_available()`".

    Returns:
        A dict with the same keys and torch tensors.

    Raises:
        TypeError: if `batch` is not a mapping or holds something that is not an array or number.

    Example:
        >>> b = to_torch({"inputs": np.zeros((2, 3), dtype=np.int64)})
        >>> b["inputs"].dtype, tuple(b["inputs"].shape)
        (torch.int64, (2, 3))
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a dict of arrays (the pipeline's output), got {type(batch).__name__}.")
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    target = torch.device(device) if device is not None else None
    pin = pin and (target is None or target.type == "cuda")  # pinning only helps copies to CUDA
    out: dict[str, torch.Tensor] = {}
    for k, v in batch.items():
        t = _leaf_to_torch(v, key=k, dtype=int_dtype, pin=pin)
        if target is not None and t.device != target:
            t = t.to(target, non_blocking=t.is_pinned())
        out[k] = t
    return out


@collator("numpy")
def identity_collate(batch: Mapping[str, Any], *, device: torch.device | str | None = None) -> Mapping[str, Any]:
    """Returns the numpy batch unchanged (for steps that take numpy, or for debugging).

    Args:
        batch: the batch.
        device: must be None (numpy has no devices).

    Returns:
        `batch`.

    Raises:
        ValueError: if a device is given.
    """
    if device is not None:
        raise ValueError(f"the 'numpy' collator cannot move data to device={device!r}; use the 'torch' collator.")
    return batch
