"""`jit`: ember's one compilation entry point (eager, Inductor or torch_xla), with state donation.

Public names: `jit`, `Jitted`, `Backend`, `Donate`.

This module validates arguments and delegates; each backend lives in `core/jit_backends/`:
    - `"eager"`: calls `fn` as is (for debugging), with the same donation semantics.
    - `"inductor"`: compiles the whole function with Inductor, once per input signature
      (structure and static fields, shapes, strides, dtypes, devices, aliasing, non-tensor leaves,
      grad mode, autocast). Tensor *values* never recompile, so pass tunables such as the learning
      rate as tensors. Tracing is strict like `torch.compile(fullgraph=True)`: reading a value
      (`.item()`, `if loss > 0`) fails at trace time. Deterministic by default (see
      `jit_backends/inductor.py`). Traced with `make_fx`; only a call whose inputs require grad
      (a jitted function differentiated from outside) or are tensor subclasses other than DTensor
      goes through Dynamo (`torch.compile(fullgraph=True)`), which compiles its backward too.
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

JAX's spellings. Every argument that is not a tensor (an int, a string, a config) is already
static: its value is baked into the compiled function and a new value compiles again, which is
what `jax.jit`'s `static_argnums` / `static_argnames` ask for; they are accepted and checked (the
arguments they name must hold no tensor). `donate_argnums=0` (or `donate_argnames` naming the first
parameter) is `donate="state"`; ember donates no other argument.

Known Inductor issue (CPU): Inductor may fuse the copy into a donated leaf with the kernel
computing its new value; if that kernel reads the same donated leaf at *other* indices (`flip`,
`roll`, a transpose), it reads overwritten values. A training step is not affected (params and
moments are read at the same index, gradients come from kernels that finish before the update);
for unusual state updates compare with `backend="eager"` once, or use `donate="none"`.

CUDA graphs (`cuda_graph=True`, inductor on a CUDA GPU, opt-in): each compiled signature runs once,
then is captured as one CUDA graph and replayed, one launch per step instead of one per kernel; the
donated state keeps its addresses, so nothing is copied (`jit_backends/cuda_graph.py`).

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

import difflib
import functools
import inspect
import time
from typing import Any, Callable, Dict, Literal, Optional, Sequence, Tuple, Union, get_args

from torch import Tensor

from .jit_backends import EagerBackend, InductorBackend, XlaBackend
from .jit_backends.cuda_graph import cuda_graph_refusal
from .jit_backends.donation import donation_error, make_entry, short_repr
from .pytree import tree_is_leaf, tree_leaves_with_path

__all__ = ["Backend", "Donate", "Jitted", "jit"]

Backend = Literal["eager", "inductor", "xla"]
Donate = Literal["none", "state"]
_BACKENDS: Tuple[str, ...] = get_args(Backend)
_DONATES: Tuple[str, ...] = get_args(Donate)

_MSG_NOT_A_PYTREE = (
    "jit(donate='state') donates the first positional argument, which must be a pytree of tensors "
    "(a TrainState, dict, list, tuple or @ember.core.pytree.dataclass), got {got}. Pass the state "
    "as a pytree, e.g. `params = dict(module.named_parameters())` instead of an nn.Module, or use "
    "donate='none'."
)


_MSG_STATIC_TENSOR = (
    "jit(static_argnums / static_argnames) marks {which} static, but the call passes a tensor there{at}. A static "
    "argument is a Python value baked into the compiled function (a new value compiles again); tensors are "
    "traced. Pass the tensor as an ordinary argument: drop it from static_argnums / static_argnames."
)


def _as_tuple(value: Union[None, int, str, Sequence[Any]]) -> Tuple[Any, ...]:
    return () if value is None else (value,) if isinstance(value, (int, str)) else tuple(value)


def _parameters(fn: Callable) -> Optional[list]:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return None


def _static_args(fn: Callable, argnums: Any, argnames: Any) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """JAX's `static_argnums` / `static_argnames` checked against `fn`'s signature, each completed from
    the other as `jax.jit` does (a positional-or-keyword parameter may be passed either way)."""
    nums, names = _as_tuple(argnums), _as_tuple(argnames)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
        raise TypeError(f"jit(static_argnums=...) takes an int or a sequence of ints, got {argnums!r}.")
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"jit(static_argnames=...) takes a str or a sequence of strs, got {argnames!r}.")
    params = _parameters(fn)
    if params is None:
        return nums, names
    name = getattr(fn, "__name__", type(fn).__name__)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    nums = tuple(n + len(positional) if n < 0 else n for n in nums)
    for n in nums:
        if not varargs and not 0 <= n < len(positional):
            raise ValueError(f"jit(static_argnums={argnums!r}): {name} takes {len(positional)} positional "
                             f"argument(s) ({', '.join(p.name for p in positional)}), so there is no argument {n}.")
    keyword = {p.name: i for i, p in enumerate(params) if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        for arg in names:
            if arg not in keyword:
                close = difflib.get_close_matches(arg, list(keyword), n=1)
                raise ValueError(f"jit(static_argnames={argnames!r}): {name} has no parameter {arg!r} "
                                 f"(it has {', '.join(keyword) or 'none'}).{f' Did you mean {close[0]!r}?' if close else ''}")
    names += tuple(p.name for i, p in enumerate(positional) if i in nums and p.kind == p.POSITIONAL_OR_KEYWORD)
    nums += tuple(keyword[n] for n in names if n in keyword and keyword[n] < len(positional))
    return tuple(sorted(set(nums))), tuple(sorted(set(names)))


def _donate_from_jax(fn: Callable, argnums: Any, argnames: Any) -> str:
    """`donate` from JAX's `donate_argnums` / `donate_argnames`: the first positional argument is "state",
    none (empty sequences) is "none"."""
    nums, names = _as_tuple(argnums), _as_tuple(argnames)
    if not nums and not names:
        return "none"
    params = _parameters(fn)
    first = params[0].name if params and params[0].kind in (params[0].POSITIONAL_ONLY,
                                                           params[0].POSITIONAL_OR_KEYWORD) else None
    if set(nums) - {0} or (names and (first is None or set(names) != {first})):
        given = ", ".join(f"{k}={v!r}" for k, v in (("donate_argnums", argnums), ("donate_argnames", argnames))
                          if v is not None)
        raise ValueError(f"jit({given}): ember donates only the first positional argument (the state), with "
                         f"donate='state'. Put the state first and pass donate='state', or drop {given}.")
    return "state"


def _choice_error(arg: str, value: Any, choices: Tuple[str, ...]) -> ValueError:
    valid = ", ".join(repr(c) for c in choices)
    return ValueError(f"jit({arg}=...) must be one of {valid}; got {value!r}.")


class Jitted:
    """A function prepared by `jit`: call it like `fn`; see the module docstring for semantics.

    Attributes:
        fn: the wrapped function.
        backend: `"eager"`, `"inductor"` or `"xla"`.
        donate: `"none"` or `"state"`.
        static: `(argnums, argnames)` of the arguments that must hold no tensor (JAX's static arguments).
        cuda_graph: whether each compiled signature is replayed as a CUDA graph.
    """

    def __init__(self, fn: Callable, *, backend: Backend, donate: Donate, mode: Optional[str],
                 options: Optional[Dict[str, Any]], deterministic: bool,
                 static: Tuple[Tuple[int, ...], Tuple[str, ...]] = ((), ()), cuda_graph: bool = False) -> None:
        self.fn, self.backend, self.donate, self.static = fn, backend, donate, static
        self.cuda_graph = cuda_graph
        entry = make_entry(fn, donate)
        if backend == "inductor":
            self._backend: Any = InductorBackend(entry, donate=donate, mode=mode, options=options,
                                                 deterministic=deterministic, cuda_graph=cuda_graph)
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
        graphed = ", cuda_graph=True" if self.cuda_graph else ""
        return f"Jitted({name}, backend={self.backend!r}, donate={self.donate!r}{graphed})"

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
        if self.static != ((), ()):
            self._check_static(args, kwargs)
        before = self.compile_count
        start = time.perf_counter()
        out, ok = self._backend(args, kwargs)
        if self.compile_count != before:
            self._compile_seconds += time.perf_counter() - start
        if not ok:
            raise donation_error(state, out)
        return out


    def _check_static(self, args: tuple, kwargs: dict) -> None:
        nums, names = self.static
        given = [(f"argument {i}", args[i]) for i in nums if i < len(args)]
        given += [(f"argument {n!r}", kwargs[n]) for n in names if n in kwargs]
        for which, value in given:
            for path, leaf in tree_leaves_with_path(value):
                if isinstance(leaf, Tensor):
                    at = f" (leaf {path!r})" if path else ""
                    raise TypeError(_MSG_STATIC_TENSOR.format(which=which, at=at))


def jit(
    fn: Optional[Callable] = None,
    *,
    backend: Backend = "inductor",
    donate: Donate = "none",
    mode: Optional[str] = None,
    options: Optional[Dict[str, Any]] = None,
    deterministic: bool = True,
    cuda_graph: bool = False,
    static_argnums: Union[None, int, Sequence[int]] = None,
    static_argnames: Union[None, str, Sequence[str]] = None,
    donate_argnums: Union[None, int, Sequence[int]] = None,
    donate_argnames: Union[None, str, Sequence[str]] = None,
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
            They override ember's own (`jit_backends.inductor.INDUCTOR_DEFAULTS`).
        deterministic: inductor only: compile with deterministic algorithms, so repeated calls on
            the same inputs give the same bits (the cost is in BENCHMARKS.md). False opts out.
        cuda_graph: inductor on a CUDA GPU only: run each compiled signature once, then capture it as
            one CUDA graph and replay that (meant for a donated step; outputs other than the donated
            state are copied out of the graph's memory each call). Off by default.
        static_argnums: JAX's spelling; the positional arguments that are static (Python values baked
            in, a new value compiles again; ember treats every non-tensor argument so): checked to hold
            no tensor.
        static_argnames: the same by parameter name.
        donate_argnums: JAX's spelling of `donate`: `0` (the state) is `donate="state"`.
        donate_argnames: the same by name: the first parameter's name is `donate="state"`.

    Returns:
        A `Jitted` callable with the signature of `fn`, exposing `compile_count` and
        `compile_seconds`; or a decorator producing one when `fn` is None.

    Raises:
        ValueError: a choice is not valid, or Inductor-only arguments are given for another
            backend, or both `mode` and `options` are given, or `cuda_graph=True` without a CUDA GPU, or a static argument `fn` does not
            have, or a donated argument other than the first.
        TypeError: `fn` is not callable or is already a `Jitted` (at a call: a static argument
            holds a tensor).
        ImportError: `backend="xla"` and torch_xla is not installed (the message says how).

    Example:
        >>> import torch
        >>> from ember.core.jit import jit
        >>> double = jit(lambda x: 2 * x, backend="eager")
        >>> double(torch.ones(2)).tolist(), double.compile_count
        ([2.0, 2.0], 0)
    """
    if fn is not None and (donate_argnums is not None or donate_argnames is not None):
        jax_donate = _donate_from_jax(fn, donate_argnums, donate_argnames)
        if donate not in ("none", jax_donate):
            raise ValueError(f"jit got donate={donate!r} and donate_argnums / donate_argnames meaning "
                             f"donate={jax_donate!r} (JAX's spelling of donate); pass only one.")
        donate = jax_donate  # type: ignore[assignment]
    for arg, value, choices in (("backend", backend, _BACKENDS), ("donate", donate, _DONATES)):
        if value not in choices:
            raise _choice_error(arg, value, choices)
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"jit(cuda_graph=...) takes True or False, got {cuda_graph!r}.")
    refusal = cuda_graph_refusal(backend, mode, options) if cuda_graph else None
    if refusal:
        raise ValueError(refusal)
    inductor_only = {"mode": mode, "options": options, "deterministic": deterministic is not True}
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
                                 deterministic=deterministic, cuda_graph=cuda_graph,
                                 static_argnums=static_argnums,
                                 static_argnames=static_argnames, donate_argnums=donate_argnums,
                                 donate_argnames=donate_argnames)
    if isinstance(fn, Jitted):
        raise TypeError(
            f"jit got a function that is already jitted ({fn!r}); wrapping twice would compile "
            f"twice. Pass the original function (`jitted.fn`) instead."
        )
    if not callable(fn):
        raise TypeError(f"jit(fn) expects a callable, got {type(fn).__name__} {short_repr(fn)}.")
    static = _static_args(fn, static_argnums, static_argnames)
    if donate == "state" and 0 in static[0]:
        raise ValueError("jit(donate='state') donates the first argument, which static_argnums marks static (a "
                         "Python value, not a tensor state); drop 0 from static_argnums or the donation.")
    return Jitted(fn, backend=backend, donate=donate, mode=mode, options=options,
                  deterministic=deterministic, static=static, cuda_graph=cuda_graph)
