"""Run real code as if its state lived on a CUDA GPU, on a machine without one.

`simulated_cuda()` is a `TorchFunctionMode` that keeps every tensor a real CPU tensor (values,
autograd, `torch.func` transforms and `.item()` all work) and tracks, per tensor, where it would
live on a GPU host:

- on the device: made with `device="cuda"` (or from `x.device` of a device tensor), moved with
  `.to("cuda")` / `.cuda()`, or computed from a device tensor. Its `.device` reads `cuda:0`.
- on the host: made by a factory without a device (`torch.tensor`, `torch.arange`, `torch.zeros`,
  ...), `.cpu()`, or computed from host tensors only.
- unknown (neutral): anything the mode never saw (made before it was entered, `torch.from_numpy`,
  a `torch.func` output whose wrapper lost its tag); it takes the other operand's side.

An op that mixes a device tensor with a host tensor of one or more dimensions raises
`DeviceMismatch` ("Expected all tensors to be on the same device"), as CUDA does; a 0-d host tensor
meeting device tensors is allowed (CUDA passes it as a scalar), and so are index tensors and
`copy_`. `.numpy()` on a device tensor raises like CUDA's. Limits: eager only (Dynamo would trace
the mode), `torch.cuda.*` calls are not simulated, and a tensor the mode never saw is trusted.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DeviceMismatch", "on_device", "simulated_cuda"]

CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_TAG = "_ember_simulated_place"
_DEVICE, _HOST = "device", "host"
_functorch = torch._C._functorch
# Functions that take index tensors (any device, as on CUDA) or copy across devices on purpose.
_CROSS_DEVICE_OK = {"__getitem__", "__setitem__", "copy_", "index_put_", "index_put", "pin_memory"}


class DeviceMismatch(RuntimeError):
    """A host tensor met a device tensor: the same code raises on a GPU."""


def _place(t: torch.Tensor) -> Optional[str]:
    while True:
        tag = getattr(t, _TAG, None)
        if tag is not None or not _functorch.is_functorch_wrapped_tensor(t):
            return tag
        t = _functorch.get_unwrapped(t)  # a torch.func wrapper: its tag sits on the tensor it wraps


def _set_place(t: Any, place: Optional[str]) -> None:
    while isinstance(t, torch.Tensor) and place is not None:
        try:
            setattr(t, _TAG, place)
        except (AttributeError, RuntimeError):
            return
        if not _functorch.is_functorch_wrapped_tensor(t):
            return
        t = _functorch.get_unwrapped(t)  # torch.func returns the inner tensor: tag it too


def _is_cuda(d: Any) -> bool:
    if isinstance(d, int) and not isinstance(d, bool):
        return True  # a bare index means a CUDA ordinal
    try:
        return isinstance(d, (str, torch.device)) and torch.device(d).type == "cuda"
    except RuntimeError:
        return False


def _to_cpu_arg(d: Any) -> Any:
    return _CPU if _is_cuda(d) else d


def _to_target(args: tuple, kwargs: dict) -> tuple[Optional[str], tuple, dict]:
    """`Tensor.to(...)`'s destination ('device', 'host' or None for a dtype-only cast) and the CPU call."""
    target, rest = None, list(args[1:])
    for i, a in enumerate(rest):
        if isinstance(a, torch.Tensor):
            target, rest[i] = _place(a) or _HOST, a.dtype
        elif isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            target, rest[i] = (_DEVICE if _is_cuda(a) else _HOST), _to_cpu_arg(a)
    if "device" in kwargs:
        target = _DEVICE if _is_cuda(kwargs["device"]) else _HOST
        kwargs = {**kwargs, "device": _to_cpu_arg(kwargs["device"])}
    return target, (args[0], *rest), kwargs


class _SimulatedCuda(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if name == "__get__" and owner in (torch.Tensor.device, torch.Tensor.is_cuda, torch.Tensor.is_cpu):
            on_device = _place(args[0]) == _DEVICE
            if owner is torch.Tensor.device:
                return CUDA if on_device else func(*args, **kwargs)
            return on_device if owner is torch.Tensor.is_cuda else not on_device
        if name in ("to", "cuda", "cpu"):
            return self._move(func, name, args, kwargs)
        if name in ("numpy", "__array__") and args and _place(args[0]) == _DEVICE:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. "
                            "Use Tensor.cpu() to copy the tensor to host memory first.")
        if name == "pin_memory":
            return args[0]  # page-locked host memory: still the host
        explicit = kwargs.get("device", None)
        if explicit is not None:
            kwargs = {**kwargs, "device": _to_cpu_arg(explicit)}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if explicit is not None:
            place = _DEVICE if _is_cuda(explicit) else _HOST
        elif name in _CROSS_DEVICE_OK or name.startswith("new_"):
            place = _place(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        else:
            place = _check_same_device(name, inputs) if inputs else _HOST
        out = func(*args, **kwargs)
        tree_map(lambda t: _set_place(t, place), out)
        return out

    @staticmethod
    def _move(func, name, args, kwargs):
        src = args[0]
        if name == "cuda":
            target, call = _DEVICE, (lambda: src.clone())
        elif name == "cpu":
            target, call = _HOST, (lambda: src.clone())
        else:
            target, args, kwargs = _to_target(args, kwargs)
            call = lambda: func(*args, **kwargs)  # noqa: E731
        if target is None or _place(src) == target:
            out = func(*args, **kwargs) if name == "to" else src
            _set_place(out, _place(src))
            return out
        out = call()
        if out is src:  # a same-dtype CPU-to-CPU .to(): the move makes a new tensor, as on a GPU
            out = src.clone()
        _set_place(out, target)
        return out


def _check_same_device(name: str, inputs: list) -> Optional[str]:
    places = [(_place(t), t.dim()) for t in inputs]
    on_device = any(p == _DEVICE for p, _ in places)
    host_arrays = [dim for p, dim in places if p == _HOST and dim > 0]
    if on_device and host_arrays:
        raise DeviceMismatch(
            f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
            f"({name}: a host tensor of {host_arrays[0]} dims met a device tensor; make it with device=x.device)")
    if on_device:
        return _DEVICE
    return _HOST if any(p == _HOST for p, _ in places) else None


@contextlib.contextmanager
def simulated_cuda() -> Iterator[torch.device]:
    """Inside: tensors placed on "cuda" are CPU tensors that behave, for placement, like CUDA ones.

    Yields the simulated device (`cuda:0`) to build the state on.
    """
    with _SimulatedCuda():
        yield CUDA


def on_device(tree: Any) -> Any:
    """Every tensor leaf of `tree` moved onto the simulated GPU (call inside `simulated_cuda()`)."""
    return tree_map(lambda t: t.to(CUDA) if isinstance(t, torch.Tensor) else t, tree)
