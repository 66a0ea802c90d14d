"""Counting `torch.compile` graph compilations, naming the input that caused a recompile.

Public names: `assert_max_compiles`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import Tensor

from ..pytree import tree_flatten_with_path
from ._compare import _MAX_LISTED, _call_path

_MSG_RECOMPILE_HINT = (
    "Usual causes: the compiled function is re-created (or re-wrapped with torch.compile) inside "
    "a loop; a Python int/float argument changes between calls (dynamo specialises on it: pass a "
    "0-d tensor instead); a static pytree field (a hyperparameter) changes. In parametrized "
    "tests, call torch.compiler.reset() between cases."
)


def _compile_count() -> int:
    from ..compat.inductor import dynamo_graph_count

    return dynamo_graph_count()


def _signature(args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    """Per input path, the properties a compiled graph specialises on."""
    flat, spec = tree_flatten_with_path((args, kwargs))
    sig: Dict[str, Dict[str, Any]] = {}
    for path, leaf in flat:
        if isinstance(leaf, Tensor):
            sig[_call_path(path)] = {
                "shape": tuple(leaf.shape),
                "dtype": leaf.dtype,
                "device": leaf.device,
                "requires_grad": leaf.requires_grad,
            }
        else:
            sig[_call_path(path)] = {"value": leaf}
    return sig, spec


def _signature_diff(old, new) -> str:
    (o, ospec), (n, nspec) = old, new
    lines = []
    for p in n:
        if p not in o:
            lines.append(f"{p}: new input")
        elif o[p] != n[p]:
            keys = [k for k in n[p] if o[p].get(k, None) != n[p][k]] or list(n[p])
            changes = ", ".join(f"{k} {o[p].get(k)!r} -> {n[p][k]!r}" for k in keys)
            lines.append(f"{p}: {changes}")
    lines += [f"{p}: input gone" for p in o if p not in n]
    if not lines and ospec != nspec:
        lines.append("the pytree structure or a static field of the inputs changed")
    if not lines:
        return (
            "nothing: the flattened inputs (shapes, dtypes, devices, Python values) are "
            "identical, so the recompile came from elsewhere (a global or closure variable, grad "
            "mode, a re-created function)"
        )
    return "; ".join(lines[:_MAX_LISTED])


class _CompileLimit:
    """Counts dynamo graph compilations while active (context manager) or per call (wrapper)."""

    def __init__(self, fn: Optional[Callable[..., Any]], n: int) -> None:
        if fn is not None:
            functools.update_wrapper(self, fn, updated=())  # names and docs, not fn's __dict__
        self.fn, self.n = fn, n
        self.start = self._count()
        self.calls = 0
        self.history: List[Tuple[int, Any, int]] = []  # (call number, signature, compiles)

    def _count(self) -> int:
        # An ember.jit function counts its own graphs (Inductor or XLA); else dynamo's global count.
        own = getattr(self.fn, "compile_count", None)
        return own if isinstance(own, int) and not isinstance(own, bool) else _compile_count()

    @property
    def compiles(self) -> int:
        """Graph compilations since this counter started."""
        return self._count() - self.start

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:
            raise TypeError("assert_max_compiles(n=...) without fn is a context manager only.")
        self.calls += 1
        sig = _signature(args, kwargs)
        before = self._count()
        out = self.fn(*args, **kwargs)
        new = self._count() - before
        if new:
            self.history.append((self.calls, sig, new))
        self._check()
        return out

    def _check(self) -> None:
        got = self.compiles
        if got <= self.n:
            return
        detail = ""
        if len(self.history) >= 2:
            (c0, s0, _), (c1, s1, _) = self.history[-2], self.history[-1]
            detail = (
                f" Call {c1} compiled again after call {c0}; between them the inputs changed: "
                f"{_signature_diff(s0, s1)}."
            )
        elif self.history and self.history[-1][2] > 1:
            detail = (
                f" Call {self.history[-1][0]} alone compiled {self.history[-1][2]} graphs: "
                f"graph breaks split the function (check with `TORCH_LOGS=graph_breaks`)."
            )
        raise AssertionError(
            f"expected at most {self.n} graph compilation"
            f"{'s' if self.n != 1 else ''}, got {got}.{detail} {_MSG_RECOMPILE_HINT}"
        )

    def __enter__(self) -> "_CompileLimit":
        self.start = self._count()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._check()


def assert_max_compiles(fn: Optional[Callable[..., Any]] = None, n: int = 1) -> Any:
    """Fail when `torch.compile` (dynamo) compiles more than `n` graphs.

    Use it as a wrapper around a compiled function, which checks after every call and, on
    failure, names the input whose shape, dtype, device or Python value changed between the
    calls that compiled; or as a context manager that checks on exit. A function made by
    `ember.core.jit` is counted by its own `compile_count` (Inductor graphs, or XLA graphs for
    `backend="xla"`); anything else by dynamo's global graph counter, so compilations of other
    functions during the calls (or inside the `with` block) count too.

    Args:
        fn: the compiled function to wrap, or None for a bare context manager.
        n: the most graph compilations allowed (counted from the wrapping / `with` entry).

    Returns:
        A callable wrapper around `fn` (also usable as `with ... as f:`), or a context manager.

    Raises:
        AssertionError: on the call (or at the end of the `with` block) that exceeds `n`, saying
            how many compilations happened and which input changed.
        TypeError: `fn` is not callable (e.g. the count passed first: use `n=`).

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_max_compiles
        >>> f = assert_max_compiles(torch.compile(lambda x: x * 2, backend="eager"), n=1)
        >>> f(torch.ones(3)).tolist(), f(torch.zeros(3)).tolist()
        ([2.0, 2.0, 2.0], [0.0, 0.0, 0.0])
        >>> with assert_max_compiles(n=0):
        ...     _ = f(torch.ones(3))   # cached: no new compilation
    """
    if fn is not None and not callable(fn):
        raise TypeError(
            f"assert_max_compiles(fn, n): fn must be callable, got {fn!r}; for a context manager "
            f"write `with assert_max_compiles(n={fn!r}):`."
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"assert_max_compiles: n must be an int >= 0, got {n!r}.")
    return _CompileLimit(fn, n)
