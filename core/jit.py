"""`jit`: ember's one compilation entry point (eager, Inductor or torch_xla), with state donation.

Public names: `jit`, `Jitted`, `Backend`, `Donate`.

This module validates arguments and delegates; each backend lives in `core/jit_backends/`:
    - `"eager"`: calls `fn` as is (for debugging), with the same donation semantics.
    - `"inductor"`: compiles the whole function with Inductor, once per input signature
      (structure and static fields, shapes, strides, dtypes, devices, aliasing, non-tensor leaves,
      grad mode, autocast). Tensor *values* never recompile, so pass tunables such as the learning
      rate as tensors. Tracing is strict like `torch.compile(fullgraph=True)`: reading a value
      (`.item()`, `if loss > 0`) fails at trace time. Deterministic by default (see
      `jit_backends/inductor.py`); `tracer` picks `make_fx` tracing (default) or Dynamo.
    - `"xla"`: arguments on `torch_xla.device()`; one graph cut per call, compiled once per
      signature. Backward passes on XLA work whatever ran before the runtime started (a CPU
      backward sizes autograd's device queues for 0 XLA devices; the step then runs its backward
      on the calling thread, see `ember.core.xla.autograd_guard`).

Donation (`donate="state"`): the first positional argument (a pytree of tensors, usually a
`TrainState`) is donated. `fn` must return a tuple or list whose first element is the new state,
with the same structure and the same shape and dtype at every leaf. The new leaves are copied into
the donated tensors inside the compiled graph (Inductor re-inplaces the copy into the kernels that
compute them, so no second copy of params and optimizer state is allocated; on XLA torch_xla
aliases the buffers), and the donated state itself is returned as the first output. The old values
are gone: clone the state first if you need them. A new leaf may be its own donated leaf unchanged
(a key, a hyperparameter), but not another donated leaf (moved or swapped leaves raise
`ValueError`), nor a view of one.

Known Inductor issue (CPU): Inductor may fuse the copy into a donated leaf with the kernel
computing its new value; if that kernel reads the same donated leaf at *other* indices (`flip`,
`roll`, a transpose), it reads overwritten values. A training step is not affected (params and
moments are read at the same index, gradients come from kernels that finish before the update);
for unusual state updates compare with `backend="eager"` once, or use `donate="none"`.

Example:
    >>> import torch
    >>> from ember.core.jit import jit
    >>> def step(state, x):
    ...     new = {"w": state["w"] - 0.5 * x}
    ...     return new, (new["w"] ** 2).sum()
    >>> fast = jit(step, backend="eager", donate="state")
    >>> state = {"w": torch.ones(3)}
    >>> ptr = state["w"].data_ptr()
    >>> state, loss = fast(state, torch.ones(3))
    >>> state["w"].tolist(), state["w"].data_ptr() == ptr
    ([0.5, 0.5, 0.5], True)
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Dict, Literal, Optional, Tuple, get_args

from torch import Tensor

from .jit_backends import EagerBackend, InductorBackend, XlaBackend
from .jit_backends.donation import donation_error, make_entry, short_repr
from .pytree import tree_is_leaf

__all__ = ["Backend", "Donate", "Jitted", "Tracer", "jit"]

Backend = Literal["eager", "inductor", "xla"]
Donate = Literal["none", "state"]
Tracer = Literal["make_fx", "dynamo"]
_BACKENDS: Tuple[str, ...] = get_args(Backend)
_DONATES: Tuple[str, ...] = get_args(Donate)
_TRACERS: Tuple[str, ...] = get_args(Tracer)

_MSG_NOT_A_PYTREE = (
    "jit(donate='state') donates the first positional argument, which must be a pytree of tensors "
    "(a TrainState, dict, list, tuple or @ember.core.pytree.dataclass), got {got}. Pass the state "
    "as a pytree, e.g. `params = dict(module.named_parameters())` instead of an nn.Module, or use "
    "donate='none'."
)


def _choice_error(arg: str, value: Any, choices: Tuple[str, ...]) -> ValueError:
    valid = ", ".join(repr(c) for c in choices)
    return ValueError(f"jit({arg}=...) must be one of {valid}; got {value!r}.")


class Jitted:
    """A function prepared by `jit`: call it like `fn`; see the module docstring for semantics.

    Attributes:
        fn: the wrapped function.
        backend: `"eager"`, `"inductor"` or `"xla"`.
        donate: `"none"` or `"state"`.
    """

    def __init__(self, fn: Callable, *, backend: Backend, donate: Donate, mode: Optional[str],
                 options: Optional[Dict[str, Any]], deterministic: bool, tracer: Tracer) -> None:
        self.fn, self.backend, self.donate = fn, backend, donate
        entry = make_entry(fn, donate)
        if backend == "inductor":
            self._backend: Any = InductorBackend(entry, donate=donate, mode=mode, options=options,
                                                 deterministic=deterministic, tracer=tracer)
        elif backend == "xla":
            self._backend = XlaBackend(entry)
        else:
            self._backend = EagerBackend(entry)
        self._compile_seconds = 0.0
        functools.update_wrapper(self, fn, updated=())

    @property
    def compile_count(self) -> int:
        """Graphs compiled so far by this function: 0 for eager, Inductor graphs, or XLA graphs."""
        return self._backend.compile_count

    @property
    def compile_seconds(self) -> float:
        """Total wall time of the calls that compiled (tracing + compiling + that call's run)."""
        return self._compile_seconds

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"Jitted({name}, backend={self.backend!r}, donate={self.donate!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = args[0] if args else None
        if self.donate == "state":
            if not args:
                raise TypeError(
                    "jit(donate='state') donates the first positional argument, but the call got "
                    "none. Call it as `fn(state, ...)`, or use donate='none'."
                )
            if not (isinstance(state, Tensor) or not tree_is_leaf(state)):
                raise TypeError(_MSG_NOT_A_PYTREE.format(got=f"{type(state).__module__}."
                                                             f"{type(state).__qualname__}"))
        before = self.compile_count
        start = time.perf_counter()
        out, ok = self._backend(args, kwargs)
        if self.compile_count != before:
            self._compile_seconds += time.perf_counter() - start
        if not ok:
            raise donation_error(state, out)
        return out


def jit(
    fn: Optional[Callable] = None,
    *,
    backend: Backend = "inductor",
    donate: Donate = "none",
    mode: Optional[str] = None,
    options: Optional[Dict[str, Any]] = None,
    deterministic: bool = True,
    tracer: Tracer = "make_fx",
) -> Any:
    """Prepare `fn` to run eagerly, under Inductor, or under torch_xla, optionally donating its state.

    Args:
        fn: the function, usually a pure `step(state, batch) -> (state, metrics)`. If omitted,
            returns a decorator: `@jit(backend="eager")`.
        backend: `"eager"`, `"inductor"` (compiled whole by Inductor) or `"xla"` (inputs on
            `torch_xla.device()`, one graph cut per call).
        donate: `"none"`, or `"state"` to write the new first output into the first argument's
            tensors and return those (see the module docstring; the old values are overwritten).
        mode: `torch.compile` mode (`"max-autotune"`, ...); inductor only.
        options: Inductor config options (`{"max_autotune": True}`); inductor only; not with `mode`.
        deterministic: inductor only: compile with deterministic algorithms, so repeated calls on
            the same inputs give the same bits (the cost is in BENCHMARKS.md). False opts out.
        tracer: inductor only: `"make_fx"` traces plain-tensor calls once per signature and hands
            the graph to Inductor (DTensor or grad-requiring inputs still go through Dynamo);
            `"dynamo"` sends every call through `torch.compile(fullgraph=True)`.

    Returns:
        A `Jitted` callable with the signature of `fn`, exposing `compile_count` and
        `compile_seconds`; or a decorator producing one when `fn` is None.

    Raises:
        ValueError: a choice is not valid, or Inductor-only arguments are given for another
            backend, or both `mode` and `options` are given.
        TypeError: `fn` is not callable or is already a `Jitted`.
        ImportError: `backend="xla"` and torch_xla is not installed (the message says how).

    Example:
        >>> import torch
        >>> from ember.core.jit import jit
        >>> double = jit(lambda x: 2 * x, backend="eager")
        >>> double(torch.ones(2)).tolist(), double.compile_count
        ([2.0, 2.0], 0)
    """
    for arg, value, choices in (("backend", backend, _BACKENDS), ("donate", donate, _DONATES),
                                ("tracer", tracer, _TRACERS)):
        if value not in choices:
            raise _choice_error(arg, value, choices)
    inductor_only = {"mode": mode, "options": options, "deterministic": deterministic is not True,
                     "tracer": tracer != "make_fx"}
    given = [k for k, v in inductor_only.items() if v is not None and v is not False]
    if backend != "inductor" and given:
        raise ValueError(
            f"jit({', '.join(f'{k}=...' for k in given)}) configure Inductor and apply only to "
            f"backend='inductor', got backend={backend!r}. Drop them, or use backend='inductor'."
        )
    if mode is not None and options is not None:
        raise ValueError(
            f"jit takes either mode or options, not both (got mode={mode!r}, options={options!r}); "
            f"fold the mode's settings into options."
        )
    if fn is None:
        return functools.partial(jit, backend=backend, donate=donate, mode=mode, options=options,
                                 deterministic=deterministic, tracer=tracer)
    if isinstance(fn, Jitted):
        raise TypeError(
            f"jit got a function that is already jitted ({fn!r}); wrapping twice would compile "
            f"twice. Pass the original function (`jitted.fn`) instead."
        )
    if not callable(fn):
        raise TypeError(f"jit(fn) expects a callable, got {type(fn).__name__} {short_repr(fn)}.")
    return Jitted(fn, backend=backend, donate=donate, mode=mode, options=options,
                  deterministic=deterministic, tracer=tracer)
