"""Where a call runs: the one module holding the ambient state ember's functions may ask about.

Public names: `Here`, `here`, `FunctionError`, `ember_trace`, `sharing_subgraphs`, `loop_body`,
`xla_loop_body`, `using_sharding`, `implicitly_replicated`, `inside_gradient`, `held_through_backward`.

An ember function computes the same numbers whoever calls it; what it may adapt is how the call
runs, and it asks that here, in one query, `here()`:

- `tracer`: `"ember"` while `jit` traces a step for Inductor (`ember_trace()`), `"dynamo"` under
  `torch.compile`, else None (eagerly, and on torch_xla's lazy tensors);
- `transform`: a `torch.func` transform is active (`vmap`, `jvp`, a user's `torch.func.grad`),
  whose engine does not see autograd's: ember's gradients and remat are plain calls there;
- `shares`: a call may become a shared subgraph (`shared_call`): ember traces with its shared
  subgraphs on (`sharing_subgraphs()`), under no transform, outside the body of one (`loop_body()`);
- `in_xla_loop`: the call is traced into an XLA `While`'s body (`xla_loop_body`);
- `sharding`: the innermost `using_sharding` value (the `Sharding` that `constrain` follows), or None;
- `gradients`: how many of ember's autograd gradients enclose the call (`inside_gradient`; grad of grad: 2).

The state is the thread's: another thread (data loading, an evaluation) never sees a training
thread's; an XLA loop's depth is the process's (autograd may run its backward on the device's thread).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, ContextManager, Iterator, List, NamedTuple, Optional

import torch

from .compat.functorch import any_transform_active

__all__ = ["FunctionError", "Here", "ember_trace", "held_through_backward", "here", "implicitly_replicated",
           "inside_gradient", "loop_body", "sharing_subgraphs", "using_sharding", "xla_loop_body"]


class FunctionError(ValueError):
    """The traced function is wrong whoever traces it (a loop body changed its carry's shape): `jit`
    raises it as is, never taking it for a broken `core/compat` patch."""


class _Thread(threading.local):
    """This thread's state (class attributes are every new thread's values; Dynamo traces reads of it)."""

    ember_tracing = False
    sharing = False
    in_body = False
    replicating = 0
    gradients = 0
    held: Optional[List[ContextManager[Any]]] = None  # the innermost gradient's, exited after its backward
    shardings: List[Any]

    def __init__(self) -> None:
        self.shardings = []


_THREAD = _Thread()
_XLA_LOOPS = [0]  # not thread-local: autograd may run an XLA loop body's backward on the device's thread


class Here(NamedTuple):
    """How the current call runs (module docstring)."""

    tracer: Optional[str]
    transform: bool
    shares: bool
    in_xla_loop: bool
    sharding: Any
    gradients: int

    @property
    def ember_traced(self) -> bool:
        """ember traces the call under no `torch.func` transform: a loop may be one node of the graph."""
        return self.tracer == "ember" and not self.transform

    @property
    def torch_func(self) -> bool:
        """Gradients here are `torch.func`'s to take: inside one of its transforms, or while Dynamo
        traces (which traces `torch.func.grad` but not `torch.autograd.grad`)."""
        return self.tracer == "dynamo" or self.transform


def here() -> Here:
    """How the current call runs: who traces it, under which transform, in which loop, with which sharding."""
    sharding = _THREAD.shardings[-1] if _THREAD.shardings else None
    if torch.compiler.is_dynamo_compiling():  # asked first: Dynamo cannot trace torch.func's level query
        return Here("dynamo", False, False, False, sharding, 0)
    tracer = "ember" if _THREAD.ember_tracing else None
    transform = any_transform_active()
    shares = tracer == "ember" and _THREAD.sharing and not _THREAD.in_body and not transform
    return Here(tracer, transform, shares, _XLA_LOOPS[0] > 0, sharding, _THREAD.gradients)


@contextlib.contextmanager
def _set(name: str, value: Any) -> Iterator[None]:
    before = getattr(_THREAD, name)
    setattr(_THREAD, name, value)
    try:
        yield
    finally:
        setattr(_THREAD, name, before)


def ember_trace() -> "contextlib.AbstractContextManager[None]":
    """Within the block `jit` traces a step for Inductor: `here().tracer` is `"ember"`."""
    return _set("ember_tracing", True)


def sharing_subgraphs() -> "contextlib.AbstractContextManager[None]":
    """Within the block ember's trace may emit shared subgraphs (the `shared_subgraph` patch is on)."""
    return _set("sharing", True)


def loop_body() -> "contextlib.AbstractContextManager[None]":
    """Within the block the trace is the body of a `scan` node or a shared subgraph, where another
    shared subgraph would nest, which Inductor does not lower (torch 2.15: "both a fallback and a
    decomp for same op: aten.t.default"): `here().shares` is False."""
    return _set("in_body", True)


def xla_loop_body(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, during whose calls `here().in_xla_loop` is True: the body of an XLA `While`."""

    @functools.wraps(fn)
    def body(*args: Any) -> Any:
        _XLA_LOOPS[0] += 1
        try:
            return fn(*args)
        finally:
            _XLA_LOOPS[0] -= 1

    return body


@contextlib.contextmanager
def using_sharding(sharding: Any) -> Iterator[None]:
    """Within the block `here().sharding` is `sharding` (None: unsharded)."""
    _THREAD.shardings.append(sharding)
    try:
        yield
    finally:
        _THREAD.shardings.pop()


@contextlib.contextmanager
def implicitly_replicated() -> Iterator[None]:
    """torch's `implicit_replication()` (plain tensors mixed with DTensors count as replicated), entered
    once however deeply nested: torch's context turns the replication off when it exits, for the outer one too."""
    from torch.distributed.tensor.experimental import implicit_replication

    depth = _THREAD.replicating
    _THREAD.replicating = depth + 1
    try:
        with implicit_replication() if depth == 0 else contextlib.nullcontext():
            yield
    finally:
        _THREAD.replicating = depth


@contextlib.contextmanager
def inside_gradient() -> Iterator[None]:
    """Within the block an ember gradient's function and backward run: `here().gradients` counts it, and
    the contexts `held_through_backward` entered inside exit at its end, in reverse order."""
    gradients, held = _THREAD.gradients, _THREAD.held
    _THREAD.gradients, _THREAD.held = gradients + 1, []
    try:
        yield
    finally:
        for context in reversed(_THREAD.held):
            context.__exit__(None, None, None)
        _THREAD.gradients, _THREAD.held = gradients, held


@contextlib.contextmanager
def held_through_backward(context: ContextManager[Any]) -> Iterator[None]:
    """Enter `context` for the block; inside an ember gradient (grad enabled), keep it entered until
    that gradient's backward is done, so what a `torch.utils.checkpoint` recomputes there sees it too
    (a bridged module's swapped-in parameters)."""
    if _THREAD.held is None or not torch.is_grad_enabled():
        with context:
            yield
        return
    context.__enter__()
    _THREAD.held.append(context)
    yield
