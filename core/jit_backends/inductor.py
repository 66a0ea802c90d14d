"""`jit(backend="inductor")`: the step compiled whole by Inductor, deterministic unless asked not to be.

Two ways in, chosen per call by the inputs:
- plain tensors that do not require grad (a pure step's state and batch): traced once per input
  signature with `make_fx` and handed to Inductor (`traced.py`), like `jax.jit`. Measured against
  `torch.compile` on both torch lines in BENCHMARKS.md (first call cold and warm, step, memory).
- tensor subclasses (DTensor) or tensors that require grad: `torch.compile(fullgraph=True,
  dynamic=False)`, Dynamo's public path.
`tracer="dynamo"` sends every call through Dynamo.

Determinism: Inductor lowers scatter-adds (an embedding's backward is one) to parallel loops with
atomic adds on multi-threaded CPUs and GPUs, so the sum's order follows thread timing and repeated
calls differ in the last bits. While ember compiles (and only then) deterministic algorithms are on,
so Inductor picks ordered kernels (pytorch/pytorch#93537); `deterministic=False` opts out. The
user's own global setting is restored after each compile; kernels run as compiled.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from ..compat.inductor import CountingInductor
from ..pytree import tree_flatten
from .donation import with_first
from .traced import FxCompiled

__all__ = ["InductorBackend", "deterministic_algorithms"]


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """`torch.use_deterministic_algorithms(True, warn_only=True)` within the block, then as before."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


class InductorBackend:
    def __init__(self, entry: Callable[..., Tuple[Any, bool]], *, donate: str, mode: Optional[str],
                 options: Optional[Dict[str, Any]], deterministic: bool, tracer: str) -> None:
        around = deterministic_algorithms if deterministic else contextlib.nullcontext
        self._donate = donate
        self._tracer = tracer
        self._counter = CountingInductor(mode, options, around_compile=around)
        self._traced = FxCompiled(entry, self._counter, around_compile=around)
        self._dynamo = torch.compile(entry, backend=self._counter, fullgraph=True, dynamic=False)

    @property
    def compile_count(self) -> int:
        return self._counter.count

    def __call__(self, args: tuple, kwargs: dict) -> Tuple[Any, bool]:
        leaves, spec = tree_flatten((args, kwargs))
        if self._tracer == "make_fx" and FxCompiled.accepts(leaves):
            out, ok = self._traced(leaves, spec)
            if ok and self._donate == "state":
                out = with_first(out, args[0])  # the donated containers themselves, as eager returns
            return out, ok
        return self._dynamo(*args, **kwargs)
