"""`jit(backend="inductor")`: the step compiled whole by Inductor, deterministic unless asked not to be.

Two ways in, chosen per call by the inputs:
- tensors that do not require grad (a pure step's state and batch), DTensors included: traced
  once per input signature with `make_fx` and handed to Inductor (`traced.py`), like `jax.jit`;
  DTensors enter the graph as their local shards (`dtensor_local.py`). Measured against
  `torch.compile` on both torch lines in BENCHMARKS.md (first call cold and warm, step, memory).
- tensors that require grad (a jitted function differentiated from outside: its backward is
  compiled too), other tensor subclasses: `torch.compile(fullgraph=True, dynamic=False)`, Dynamo's
  public path. A whole-step Dynamo option (`tracer="dynamo"`) was removed: it compiled the same
  step 1.8x slower cold and 4.4x slower warm (BENCHMARKS.md, "One tracer").

Determinism: an embedding's backward is a scatter-add (`index_put_` with accumulate). Inductor
keeps it as a call of the ATen kernel, which on a multi-threaded CPU adds with atomics unless
deterministic algorithms are on when it *runs*; so the order of the sum follows thread timing and
repeated calls differ in the last bits (pytorch/pytorch#93537). On a GPU the attention backward
passes do the same unless deterministic algorithms are strict. While ember compiles and while each
compiled call runs, `determinism.deterministic_algorithms()` is in force (strict deterministic
algorithms, SDPA backends with deterministic backward passes, cuBLAS's deterministic workspace),
and the user's own settings are restored after; an op with no deterministic kernel raises naming
itself and the fix. `deterministic=False` opts out (the fast path). The cost is a ratio in BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..compat.inductor import CountingInductor
from ..local_shards import has_dtensor, rewrap, to_local
from ..pytree import tree_flatten, tree_unflatten
from . import dtensor_local
from .cuda_graph import cuda_graphed
from .determinism import deterministic_algorithms, determinism_error, ensure_cublas_workspace_config, notice_once
from .donation import with_first
from .traced import FxCompiled

__all__ = ["INDUCTOR_DEFAULTS", "InductorBackend", "deterministic_algorithms"]

INDUCTOR_DEFAULTS: Dict[str, Any] = {"realize_reads_threshold": 16}
"""Inductor options every ember compile starts from; `jit(options=...)` overrides them. Inductor keeps a
value with several users in a buffer of its own once it reads more than 4 buffers (0-d ones count), so an
optimizer update's new moments (read by the state and by the parameter's update) were written twice:
BENCHMARKS.md, "Why the 125M update writes its moments twice"."""


class InductorBackend:
    def __init__(self, entry: Callable[..., Tuple[Any, bool]], *, donate: str, mode: Optional[str],
                 options: Optional[Dict[str, Any]], deterministic: bool,
                 cuda_graph: bool = False) -> None:
        # Every compile happens inside a call, so one scope covers compiling and running.
        self._deterministic = deterministic
        self._around_call = deterministic_algorithms if deterministic else contextlib.nullcontext
        if deterministic and torch.cuda.is_available():
            ensure_cublas_workspace_config()  # before cuBLAS starts: it reads it once
        self._donate = donate
        self._counter = CountingInductor(mode, {**INDUCTOR_DEFAULTS, **(options or {})})
        self._cuda_graph = cuda_graph  # each traced graph replayed as a CUDA graph (`cuda_graph.py`)
        self._traced = FxCompiled(entry, cuda_graphed(self._counter) if cuda_graph else self._counter)
        self._traced_local = FxCompiled(dtensor_local.local_entry(entry), self._counter)
        self._dynamo = torch.compile(entry, backend=self._counter, fullgraph=True, dynamic=False)

    @property
    def compile_count(self) -> int:
        return self._counter.count

    def __call__(self, args: tuple, kwargs: dict) -> Tuple[Any, bool]:
        leaves, spec = tree_flatten((args, kwargs))
        if not self._deterministic:
            return self._dispatch(args, kwargs, leaves, spec)
        device = next((t.device.type for t in leaves if isinstance(t, torch.Tensor)), "cpu")
        notice_once(device)  # on a GPU, once per process, before the first step
        try:
            return self._dispatch(args, kwargs, leaves, spec)
        except RuntimeError as err:
            rewritten = determinism_error(err, device)
            if rewritten is None:
                raise
            raise rewritten from err

    def _dispatch(self, args: tuple, kwargs: dict, leaves: list, spec: Any) -> Tuple[Any, bool]:
        with self._around_call():
            if has_dtensor(leaves):
                self._refuse_cuda_graph("a DTensor argument (a sharded step)")
                out, ok = self._call_on_local_shards(leaves, spec)
            elif FxCompiled.accepts(leaves):
                out, ok = self._traced(leaves, spec)
            else:
                self._refuse_cuda_graph("a tensor that requires grad (such calls go through Dynamo)")
                return self._dynamo(*args, **kwargs)
            if ok and self._donate == "state":
                out = with_first(out, args[0])  # the donated containers, as eager returns them
            return out, ok

    def _refuse_cuda_graph(self, what: str) -> None:
        if self._cuda_graph:
            raise ValueError(f"jit(cuda_graph=True) captures a one-device step of plain tensors, but the call "
                             f"passes {what}; drop cuda_graph=True for this step.")

    def _call_on_local_shards(self, leaves: list, spec: Any) -> Tuple[Any, bool]:
        local, layouts = to_local(leaves)
        if not FxCompiled.accepts(local):
            args, kwargs = tree_unflatten(leaves, spec)
            return self._dynamo(*args, **kwargs)
        args, kwargs = tree_unflatten(local, spec)
        packed, packed_spec = tree_flatten(((layouts, args, kwargs), {}))
        out, ok = self._traced_local(packed, packed_spec)
        if not ok:
            return out, ok
        local_out, out_layouts = out
        out_leaves, out_spec = tree_flatten(local_out)
        return tree_unflatten(rewrap(out_leaves, out_layouts), out_spec), True
