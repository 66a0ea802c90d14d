"""`jit(backend="xla")`: trace lazily under torch_xla and cut one graph per call, compiled once per signature.

Arguments must already live on the XLA device (a CPU tensor raises `ValueError` naming its path).
Each call first materialises pending work on its input tensors, then runs the entry lazily and
cuts one graph whose outputs are exactly the call's output tensors; torch_xla caches compiled
graphs by hash, so the step compiles at call 1 and never again for the same shapes (tested over
20 steps, also after an lr change). Why each part is needed:
- the input sync: a state built on the device (optimizer zeros made lazily) would otherwise fold
  its own initialisation into call 1's graph, and call 2 would compile again;
- a targeted sync instead of `torch_xla.sync()`: a global sync also picks up any other live tensor
  with pending work (intermediates kept alive until the garbage collector runs), so the graph, and
  the compile count, would depend on GC timing;
- `_own_scalar_buffers`: see its docstring;
- `xla.autograd_guard`: a backward pass that ran before the runtime started (a CPU reference, an
  earlier test) would otherwise break every backward on XLA (see `ember.core.xla`).
`compile_count` counts graphs compiled during the step itself (torch_xla counter
`UncachedCompile`), not the inputs' materialisation.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor

from .. import xla
from ..compat import torch_xla as xla_internals
from ..pytree import keystr, tree_flatten_with_path, tree_leaves

__all__ = ["XlaBackend"]

_MSG_AUTOGRAD_BEFORE_XLA = (
    "jit(backend='xla'): autograd failed on the XLA device because its worker queues were sized "
    "before the torch_xla runtime started (a backward pass ran first, even on CPU), and running "
    "the backward on the calling thread did not help either. Start the runtime first: call "
    "`ember.core.xla.start_runtime()` (after ember.core.xla.xla_cpu_devices(n) if you need n CPU "
    "devices) before any backward, e.g. at the top of the script or in a pytest conftest.py."
)


def _own_scalar_buffers(inputs: List[Tensor], owned: Dict[int, Tuple[weakref.ref, Any]]) -> None:
    """Give each 0-d XLA input its own computed buffer, unless it holds what the last call returned.

    torch_xla uploads a 0-d host tensor (`torch.tensor(0.9).to(dev)`) into a read-only device
    buffer that it caches by value and shares with every other scalar of that value and dtype,
    including constants the traced step creates. The graph's hash covers which parameters share a
    buffer and which are read-only, so a step traced from such scalars differs from the same step
    traced from its own outputs, and call 2 compiled again (measured `[1, 1, 0, 0]`). Multiplying
    in place by one (`logical_or` with itself for bool) keeps the tensor objects, and so a donated
    state's identity; the caller's sync then materialises private buffers. Tensors still holding
    what the previous call returned (`owned`: id -> weak reference and data id) are skipped, so a
    steady-state step launches no extra graph. Views are skipped: the sync computes their base.
    """
    seen = set()
    with torch.no_grad():
        for t in inputs:
            if t.ndim != 0 or id(t) in seen or xla_internals.is_view(t):
                continue
            seen.add(id(t))
            entry = owned.get(id(t))
            if entry is not None and entry[0]() is t and entry[1] == xla_internals.data_id(t):
                continue
            if t.dtype == torch.bool:
                t.logical_or_(t)
            else:
                t.mul_(1)


class XlaBackend:
    def __init__(self, entry: Callable[..., Tuple[Any, bool]]) -> None:
        xla.require_torch_xla("jit(backend='xla')")
        self._entry = entry
        self.compile_count = 0
        # id -> (weak reference, torch_xla data id) of the 0-d tensors the last call returned.
        self._owned: Dict[int, Tuple[weakref.ref, Any]] = {}

    def __call__(self, args: tuple, kwargs: dict) -> Tuple[Any, bool]:
        inputs = []
        for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
            if not isinstance(leaf, Tensor):
                continue
            inputs.append(leaf)
            if leaf.device.type != "xla":
                where = ("args." if path[0].idx == 0 else "kwargs.") + keystr(path[1:])
                raise ValueError(
                    f"jit(backend='xla') expects every tensor argument on the XLA device, but "
                    f"{where} is on {leaf.device}. Move inputs first, e.g. "
                    f"`tree_map(lambda t: t.to(torch_xla.device()), batch)`."
                )
        _own_scalar_buffers(inputs, self._owned)
        xla.sync(inputs)
        before = xla.compile_count()
        device = inputs[0].device if inputs else xla.start_runtime("jit(backend='xla')")
        try:
            with xla.autograd_guard(device):  # a backward that ran before the runtime is harmless
                out = self._entry(*args, **kwargs)
        except RuntimeError as err:
            if "device_ready_queues_" in str(err):
                raise RuntimeError(_MSG_AUTOGRAD_BEFORE_XLA) from err
            raise
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        xla.sync(outputs)
        self.compile_count += xla.compile_count() - before
        self._owned = {id(t): (weakref.ref(t), xla_internals.data_id(t))
                       for t in outputs if t.ndim == 0 and t.device.type == "xla"}
        return out
