"""One traced and compiled subgraph for repeated calls in ember's Inductor step (microbatches, layers).

A patch (`WORKAROUNDS["shared_subgraph"]`), on inside ember's own `jit(backend="inductor")`
compiles. A Python loop over microbatches or layers unrolls into the traced graph, so Inductor
compiles `k` copies of the body. torch's `invoke_subgraph` higher-order op makes every call with
the same identifier one node pointing at one subgraph, which Inductor lowers once. Its public
marker, `torch.compiler.nested_compile_region`, acts only under Dynamo; ember traces with
`make_fx`, where the marker does nothing, so `call_shared` emits the op itself. `make_fx` keeps
one subgraph per identifier only inside a `TracingContext`, which the patch provides while ember
traces. Whether a call is shared is the caller's to ask (`ember.core.trace_context`: `here().shares`,
False with the patch off); where it is not, the call is plain: the same numbers, unrolled.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

__all__ = ["call_shared", "function_index", "shared_subgraphs"]

T = TypeVar("T")


@contextlib.contextmanager
def shared_subgraphs() -> Iterator[None]:
    """While ember traces a step: one trace per `invoke_subgraph` identifier is kept."""
    from torch._guards import TracingContext, tracing

    if TracingContext.try_get() is None:
        with tracing(TracingContext(None)):  # holds make_fx's subgraph cache; no fake mode of its own
            yield
    else:
        yield


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
    """`tuple(fn(*tensors))` as one `invoke_subgraph` node: traced once per `identifier` in ember's trace.

    `fn` takes and returns tensors only, must not mutate or return its inputs, and must give the
    same graph for every call with the same `identifier` (the caller puts shapes and constants in it).
    """
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    # The op traces its body below autograd; a body that takes gradients itself (a microbatch's
    # `value_and_grad`, remat's backward) needs its caller's dispatch keys back, or every gradient
    # it takes is silently zero. torch's own lazy backward of the op restores them the same way.
    keys = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())

    def body(*ts: Tensor) -> Tuple[Tensor, ...]:
        with torch._C._ForceDispatchKeyGuard(*keys):
            return tuple(fn(*ts))

    return tuple(invoke_subgraph(body, identifier, *tensors))
