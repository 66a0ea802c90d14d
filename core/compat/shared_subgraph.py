"""One traced and compiled subgraph for repeated calls in ember's Inductor step (microbatches, layers).

A patch (`WORKAROUNDS["shared_subgraph"]`), on inside ember's own `jit(backend="inductor")`
compiles. A Python loop over microbatches or layers unrolls into the traced graph, so Inductor
compiles `k` copies of the body. torch's `invoke_subgraph` higher-order op makes every call with
the same identifier one node pointing at one subgraph, which Inductor lowers once. Its public
marker, `torch.compiler.nested_compile_region`, acts only under Dynamo; ember traces with
`make_fx`, where the marker does nothing, so `call_shared` emits the op itself. `make_fx` keeps
one subgraph per identifier only inside a `TracingContext`, which the patch provides while ember
traces. Where the op is not used (eagerly, on XLA, under Dynamo, under `vmap`, or with the patch
off) `call_shared` is a plain call: the same numbers, unrolled.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

from .functorch import any_transform_active

__all__ = ["call_shared", "function_index", "plain_calls", "shared_subgraphs", "sharing"]

_state = threading.local()
T = TypeVar("T")


@contextlib.contextmanager
def shared_subgraphs() -> Iterator[None]:
    """While ember traces a step: `call_shared` emits `invoke_subgraph`, and one trace per identifier is kept."""
    from torch._guards import TracingContext, tracing

    before = getattr(_state, "active", False)
    _state.active = True
    try:
        if TracingContext.try_get() is None:
            with tracing(TracingContext(None)):  # holds make_fx's subgraph cache; no fake mode of its own
                yield
        else:
            yield
    finally:
        _state.active = before


def sharing() -> bool:
    """Whether a call here would become a shared subgraph: ember's make_fx trace, outside any shared
    body, with no functorch transform active."""
    return (getattr(_state, "active", False) and not getattr(_state, "inside", False)
            and torch.compiler.is_compiling() and not torch.compiler.is_dynamo_compiling()
            and not any_transform_active())


@contextlib.contextmanager
def plain_calls() -> Iterator[None]:
    """Within the block `sharing()` is False: the body of a shared subgraph or of a `scan` node, where a
    shared subgraph would nest in another, which Inductor does not lower (torch 2.15: "both a fallback
    and a decomp for same op: aten.t.default")."""
    before = getattr(_state, "inside", False)
    _state.inside = True
    try:
        yield
    finally:
        _state.inside = before


def function_index(fn: Callable, name: str) -> int:
    """`fn`'s rank among the distinct functions that used `name` in this trace (0 for the first).

    Kept on the trace's `TracingContext`, which holds the functions alive, so no two functions
    of one trace share an identifier even if one of them is garbage-collected meanwhile.
    """
    from torch._guards import TracingContext

    registry = TracingContext.get().__dict__.setdefault("_ember_shared_functions", {})
    seen = registry.setdefault(name, [])
    for i, known in enumerate(seen):
        if known is fn:
            return i
    seen.append(fn)
    return len(seen) - 1


def call_shared(fn: Callable[..., Sequence[Tensor]], identifier: str,
                tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """`tuple(fn(*tensors))`, traced once per `identifier` and compiled once when `sharing()`.

    `fn` takes and returns tensors only, must not mutate or return its inputs, and must give the
    same graph for every call with the same `identifier` (the caller puts shapes and constants in it).
    """
    if not sharing():
        return tuple(fn(*tensors))
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    # The op traces its body below autograd; a body that takes gradients itself (a microbatch's
    # `value_and_grad`, remat's backward) needs its caller's dispatch keys back, or every gradient
    # it takes is silently zero. torch's own lazy backward of the op restores them the same way.
    keys = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())

    def body(*ts: Tensor) -> Tuple[Tensor, ...]:
        with plain_calls(), torch._C._ForceDispatchKeyGuard(*keys):
            return tuple(fn(*ts))

    return tuple(invoke_subgraph(body, identifier, *tensors))
