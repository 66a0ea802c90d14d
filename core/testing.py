"""Assertions and helpers for unit-testing pure step functions on CPU.

Public names: `assert_trees_all_close` (alias `assert_trees_close`), `assert_trees_all_equal`,
`assert_trees_all_equal_structs`, `assert_tree_shapes`, `assert_tree_dtypes`,
`assert_tree_all_finite`, `assert_shape`, `check_grads`, `assert_pure`, `assert_max_compiles`,
`run_on_backends`, `typechecked`.

Every tree assertion raises `AssertionError` naming the first bad leaf by its dotted path
(`params.blocks.0.wq`), with the max absolute / relative error, shapes and dtypes. Tensors on other
devices (torch_xla) and DTensors (through `.full_tensor()`) are brought to CPU before comparing.

Example:
    >>> import torch
    >>> from ember.core import testing
    >>> testing.assert_trees_all_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-9})
    >>> testing.assert_shape(torch.zeros(2, 3, 4), (2, None, ...))
    >>> try:
    ...     testing.assert_trees_all_close({"w": torch.ones(2)}, {"w": torch.zeros(2)})
    ... except AssertionError as e:
    ...     print(str(e).splitlines()[0])
    trees are not close at leaf 'w' (1 of 1 leaves differ; the first is shown):
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten
from .types import PyTree

__all__ = [
    "assert_max_compiles",
    "assert_pure",
    "assert_shape",
    "assert_tree_all_finite",
    "assert_tree_dtypes",
    "assert_tree_shapes",
    "assert_trees_all_close",
    "assert_trees_all_equal",
    "assert_trees_all_equal_structs",
    "assert_trees_close",
    "check_grads",
    "run_on_backends",
    "typechecked",
]

Backend = Literal["eager", "inductor", "xla"]
_BACKENDS = ("eager", "inductor", "xla")
_MAX_LISTED = 10

_MSG_RECOMPILE_HINT = (
    "Usual causes: the compiled function is re-created (or re-wrapped with torch.compile) inside "
    "a loop; a Python int/float argument changes between calls (dynamo specialises on it: pass a "
    "0-d tensor instead); a static pytree field (a hyperparameter) changes. In parametrized "
    "tests, call torch._dynamo.reset() between cases."
)


# ----------------------------------------------------------------------------- leaves and devices


def _to_cpu(x: Any) -> Any:
    """Detach a tensor and bring it to CPU (DTensors gathered with `.full_tensor()`)."""
    if not isinstance(x, Tensor):
        return x
    if callable(getattr(x, "full_tensor", None)):  # DTensor
        x = x.full_tensor()
    x = x.detach()
    return x if x.device.type == "cpu" else x.cpu()


def _name(path: str) -> str:
    return path if path else "<root>"


def _leaves(tree: PyTree) -> Tuple[List[Tuple[str, Any]], Any]:
    leaves, spec = tree_flatten_with_path(tree)
    return [(keystr(p), leaf) for p, leaf in leaves], spec


def _shape(x: Any) -> Tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else ()


def _dtype(x: Any) -> Any:
    return x.dtype if isinstance(x, Tensor) else type(x).__name__


def _as_tensor(x: Any) -> Optional[Tensor]:
    """A CPU tensor for tensors, numpy arrays and numbers; None for anything else."""
    if isinstance(x, Tensor):
        return _to_cpu(x)
    if isinstance(x, (bool, int, float, complex)) or hasattr(x, "__array__"):
        try:
            return torch.as_tensor(x)
        except (TypeError, RuntimeError, ValueError):
            return None
    return None


def _structure_diff(a: PyTree, b: PyTree) -> Optional[str]:
    la, sa = _leaves(a)
    lb, sb = _leaves(b)
    if sa == sb:
        return None
    pa, pb = [p for p, _ in la], [p for p, _ in lb]
    set_a, set_b = set(pa), set(pb)
    only_a = [_name(p) for p in pa if p not in set_b][:_MAX_LISTED]
    only_b = [_name(p) for p in pb if p not in set_a][:_MAX_LISTED]
    if only_a or only_b:
        return (
            f"trees differ in structure: paths only in the first: {only_a}; "
            f"only in the second: {only_b}"
        )
    return (
        f"trees have the same leaf paths but different containers or static fields:\n"
        f"  first:  {sa}\n  second: {sb}"
    )


def _check_structure(a: PyTree, b: PyTree) -> List[Tuple[str, Any, Any]]:
    diff = _structure_diff(a, b)
    if diff is not None:
        raise AssertionError(diff)
    la, _ = _leaves(a)
    lb, _ = _leaves(b)
    return [(p, x, y) for (p, x), (_, y) in zip(la, lb)]


def _index(flat_idx: int, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat_idx % size)
        flat_idx //= size
    return tuple(reversed(out))


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else repr(v)


def _is_integral(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


def _compare_leaf(x: Any, y: Any, *, rtol: float, atol: float, exact: bool) -> Optional[str]:
    """None if the leaves match, else the lines describing how they differ."""
    tx, ty = _as_tensor(x), _as_tensor(y)
    if tx is None or ty is None:
        if tx is None and ty is None and x == y:
            return None
        return f"  values differ: {x!r} (first) vs {y!r} (second)"
    meta = f"  shapes {tuple(tx.shape)} vs {tuple(ty.shape)}; dtypes {_dtype(tx)} vs {_dtype(ty)}"
    if tx.shape != ty.shape:
        return "  shapes differ\n" + meta
    if exact and tx.dtype != ty.dtype:
        return "  dtypes differ\n" + meta
    work = torch.complex128 if (tx.is_complex() or ty.is_complex()) else torch.float64
    a64, b64 = tx.to(work).reshape(-1), ty.to(work).reshape(-1)
    both_nan = a64.isnan() & b64.isnan()
    if _is_integral(tx) and _is_integral(ty):
        # Compare integers exactly in int64: float64 would round 64-bit values such as RNG keys.
        ai, bi = tx.to(torch.int64).reshape(-1), ty.to(torch.int64).reshape(-1)
        ok = ai == bi
        if not exact:
            small = (a64.abs() < 2.0**53) & (b64.abs() < 2.0**53)
            ok = ok | (small & torch.isclose(a64, b64, rtol=rtol, atol=atol))
    elif exact:
        ok = (a64 == b64) | both_nan
    else:
        ok = torch.isclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True)
    if bool(ok.all()):
        return None
    err = (a64 - b64).abs().nan_to_num(nan=math.inf)  # a NaN against a number counts as inf
    err = torch.where(ok, torch.zeros_like(err), err)
    # The element shown is the worst failing one (err may round to 0 for huge integers).
    worst = int(torch.where(ok, torch.full_like(err, -1.0), err).argmax())
    rel = err / b64.abs()
    rel = torch.where(err == 0, torch.zeros_like(rel), rel)
    idx = _index(worst, tuple(tx.shape))
    tol = "exactly" if exact else f"rtol={rtol:g}, atol={atol:g}"
    return (
        f"  {int((~ok).sum())} of {ok.numel()} elements differ ({tol})\n"
        f"  max abs error {float(err.max()):.6g} at index {idx}: "
        f"{_fmt(tx.reshape(-1)[worst].item())} (first) vs {_fmt(ty.reshape(-1)[worst].item())} "
        f"(second)\n"
        f"  max rel error {float(rel.max()):.6g}\n" + meta
    )


def _compare_trees(a: PyTree, b: PyTree, *, rtol: float, atol: float, exact: bool, what: str) -> None:
    failures = []
    for path, x, y in _check_structure(a, b):
        msg = _compare_leaf(x, y, rtol=rtol, atol=atol, exact=exact)
        if msg is not None:
            failures.append((path, msg))
    if failures:
        path, msg = failures[0]
        n_leaves = len(_leaves(a)[0])
        others = [_name(p) for p, _ in failures[1 : 1 + _MAX_LISTED]]
        tail = f"\n  other differing leaves: {others}" if others else ""
        raise AssertionError(
            f"trees are not {what} at leaf '{_name(path)}' ({len(failures)} of {n_leaves} leaves "
            f"differ; the first is shown):\n{msg}{tail}"
        )


# ------------------------------------------------------------------------------ tree assertions


def assert_trees_all_close(a: PyTree, b: PyTree, *, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Assert two pytrees have the same structure and element-wise close leaves.

    A leaf passes when `|a - b| <= atol + rtol * |b|` for every element (`b` is the expected
    value), compared in float64; NaNs in the same positions are equal. Dtypes may differ (so a
    bf16 result can be checked against an fp32 reference); shapes may not. Non-tensor leaves are
    compared with `==`.

    Args:
        a: the actual pytree (tensors, numpy arrays or numbers as leaves).
        b: the expected pytree, same structure.
        rtol: relative tolerance.
        atol: absolute tolerance.

    Raises:
        AssertionError: structures differ (listing the paths only in one tree), or a leaf is not
            close: names its dotted path, how many elements differ, the max abs error with its
            index and both values, the max rel error, both shapes and dtypes.

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_trees_all_close
        >>> assert_trees_all_close({"w": torch.ones(3)}, {"w": torch.ones(3, dtype=torch.float64)})
    """
    _compare_trees(a, b, rtol=rtol, atol=atol, exact=False, what="close")


assert_trees_close = assert_trees_all_close


def assert_trees_all_equal(a: PyTree, b: PyTree) -> None:
    """Assert two pytrees have the same structure, shapes, dtypes and exactly equal values.

    NaNs in the same positions count as equal, so the check reads "bit-identical results".

    Args:
        a: the actual pytree.
        b: the expected pytree.

    Raises:
        AssertionError: structures, shapes or dtypes differ, or any element differs (the message
            is as for `assert_trees_all_close`).

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_trees_all_equal
        >>> assert_trees_all_equal([torch.tensor(float("nan"))], [torch.tensor(float("nan"))])
    """
    _compare_trees(a, b, rtol=0.0, atol=0.0, exact=True, what="equal")


def assert_trees_all_equal_structs(a: PyTree, b: PyTree) -> None:
    """Assert two pytrees have the same structure (containers, keys, static fields), ignoring leaves.

    Raises:
        AssertionError: listing the paths present in only one tree, or both tree specs when
            the paths agree but containers or static fields differ.

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_trees_all_equal_structs
        >>> assert_trees_all_equal_structs({"w": torch.ones(2)}, {"w": torch.zeros(5)})
    """
    diff = _structure_diff(a, b)
    if diff is not None:
        raise AssertionError(diff)


def _is_shape_spec(x: Any) -> bool:
    if isinstance(x, torch.Size):
        return True
    return isinstance(x, (tuple, list)) and all(
        d is None or d is Ellipsis or isinstance(d, (int, set, frozenset)) for d in x
    )


def _dim_ok(d: int, spec: Any) -> bool:
    if spec is None:
        return True
    if isinstance(spec, (set, frozenset)):
        return d in spec
    return d == spec


def _check_spec(spec: Any) -> Tuple[Any, ...]:
    if not _is_shape_spec(spec):
        raise TypeError(
            f"expected shape must be a tuple of ints, None (any size), ... (any number of dims) "
            f"or sets of ints ({{1, 3}}), got {spec!r}."
        )
    spec = tuple(spec)
    if sum(d is Ellipsis for d in spec) > 1:
        raise ValueError(f"expected shape {spec!r} has more than one `...`; use at most one.")
    for d in spec:
        if isinstance(d, bool) or (isinstance(d, (set, frozenset)) and not all(
            isinstance(v, int) and not isinstance(v, bool) for v in d
        )):
            raise TypeError(f"expected shape {spec!r}: dims must be ints, None, ... or sets of ints.")
    return spec


def _shape_matches(shape: Tuple[int, ...], spec: Tuple[Any, ...]) -> bool:
    if any(d is Ellipsis for d in spec):
        i = next(k for k, d in enumerate(spec) if d is Ellipsis)
        pre, post = spec[:i], spec[i + 1 :]
        if len(shape) < len(pre) + len(post):
            return False
        tail = shape[len(shape) - len(post) :] if post else ()
        return all(map(_dim_ok, shape[: len(pre)], pre)) and all(map(_dim_ok, tail, post))
    return len(shape) == len(spec) and all(map(_dim_ok, shape, spec))


def _fmt_spec(spec: Tuple[Any, ...]) -> str:
    parts = ["..." if d is Ellipsis else ("*" if d is None else repr(d)) for d in spec]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def assert_shape(x: Any, expected: Sequence[Any]) -> None:
    """Assert the shape of a tensor (or of each tensor in a list/tuple) matches `expected`.

    Args:
        x: a tensor (or anything with `.shape`), or a list/tuple of them.
        expected: a shape whose entries are ints, `None` (any size), sets of ints (`{1, 3}`: any
            of these) and at most one `...` (any number of dims, including none).

    Raises:
        AssertionError: listing every input that does not match, with its actual shape.
        TypeError: `expected` is not a shape specification.

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_shape
        >>> assert_shape([torch.zeros(2, 3), torch.zeros(2, 1)], (2, {1, 3}))
        >>> assert_shape(torch.zeros(4), (..., 4))
    """
    spec = _check_spec(expected)
    inputs = list(x) if isinstance(x, (list, tuple)) else [x]
    bad = [
        f"input {i}: shape {_shape(t)}" if len(inputs) > 1 else f"shape {_shape(t)}"
        for i, t in enumerate(inputs)
        if not _shape_matches(_shape(t), spec)
    ]
    if bad:
        raise AssertionError(
            f"expected shape {_fmt_spec(spec)} (* = any size), got " + "; ".join(bad)
        )


def _expected_leaves(tree: PyTree, expected: Any, is_single: Callable[[Any], bool], what: str):
    leaves, spec = _leaves(tree)
    if is_single(expected):
        return [(p, x, expected) for p, x in leaves]
    try:
        exp_leaves = spec.flatten_up_to(expected)
    except (ValueError, TypeError, RuntimeError) as e:
        raise AssertionError(
            f"expected {what} do not match the tree's structure: {e}. Pass one {what[:-1]} for "
            f"every leaf, or a pytree of them with the tree's structure."
        ) from None
    return [(p, x, e) for (p, x), e in zip(leaves, exp_leaves)]


def assert_tree_shapes(tree: PyTree, expected: Any) -> None:
    """Assert the shape of every leaf of `tree`.

    Args:
        tree: a pytree of tensors.
        expected: one shape (wildcards as in `assert_shape`) that every leaf must match, or a
            pytree with the structure of `tree` whose leaves are shapes or tensors (whose shapes
            are used).

    Raises:
        AssertionError: listing each mismatching leaf's dotted path, actual and expected shape.

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_tree_shapes
        >>> params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
        >>> assert_tree_shapes(params, {"w": (4, 3), "b": (None,)})
        >>> assert_tree_shapes(params, (..., 3))
    """
    def is_single(e: Any) -> bool:
        return _is_shape_spec(e) or isinstance(e, Tensor)

    bad = []
    for path, x, e in _expected_leaves(tree, expected, is_single, "shapes"):
        spec = tuple(e.shape) if isinstance(e, Tensor) else _check_spec(e)
        if not _shape_matches(_shape(x), spec):
            bad.append(f"'{_name(path)}': shape {_shape(x)}, expected {_fmt_spec(spec)}")
    if bad:
        raise AssertionError(
            f"{len(bad)} leaves have unexpected shapes (* = any size):\n  "
            + "\n  ".join(bad[:_MAX_LISTED])
        )


def assert_tree_dtypes(tree: PyTree, expected: Any) -> None:
    """Assert the dtype of every leaf of `tree`.

    Args:
        tree: a pytree of tensors.
        expected: one `torch.dtype` for every leaf, or a pytree with the structure of `tree`
            whose leaves are dtypes.

    Raises:
        AssertionError: listing each mismatching leaf's dotted path, actual and expected dtype.

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_tree_dtypes
        >>> assert_tree_dtypes({"w": torch.zeros(2), "step": torch.tensor(0)},
        ...                    {"w": torch.float32, "step": torch.int64})
    """
    bad = [
        f"'{_name(p)}': {_dtype(x)}, expected {e}"
        for p, x, e in _expected_leaves(
            tree, expected, lambda e: isinstance(e, torch.dtype), "dtypes"
        )
        if _dtype(x) != e
    ]
    if bad:
        raise AssertionError(
            f"{len(bad)} leaves have unexpected dtypes:\n  " + "\n  ".join(bad[:_MAX_LISTED])
        )


def assert_tree_all_finite(tree: PyTree) -> None:
    """Assert every element of every floating leaf is finite (no NaN, no inf).

    Raises:
        AssertionError: naming the first leaf with a non-finite element: its dotted path, how
            many elements are NaN / inf, the index of the first one, shape and dtype.

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_tree_all_finite
        >>> assert_tree_all_finite({"w": torch.ones(2), "step": torch.tensor(3)})
    """
    for path, x in _leaves(tree)[0]:
        t = _as_tensor(x)
        if t is None or not (t.is_floating_point() or t.is_complex()):
            continue
        finite = torch.isfinite(t).reshape(-1)
        if bool(finite.all()):
            continue
        n_nan = int(t.isnan().sum())
        first = _index(int((~finite).to(torch.int8).argmax()), tuple(t.shape))
        raise AssertionError(
            f"leaf '{_name(path)}' has {int((~finite).sum())} non-finite of {t.numel()} elements "
            f"({n_nan} NaN, {int((~finite).sum()) - n_nan} inf), the first at index {first}; "
            f"shape {tuple(t.shape)}, dtype {t.dtype}"
        )


# ------------------------------------------------------------------------------ function checks


def _call_path(path: Tuple[Any, ...]) -> str:
    """Render a path into `(args, kwargs)` as `args[0].params.w` / `kwargs['x'].w`."""
    if not path:
        return "<inputs>"
    is_args = getattr(path[0], "idx", 0) == 0
    if len(path) == 1:
        return "args" if is_args else "kwargs"
    head = keystr(path[1:2])
    base = f"args[{head}]" if is_args else f"kwargs[{head!r}]"
    rest = keystr(path[2:])
    return base + (f".{rest}" if rest else "")


def check_grads(
    fn: Callable[..., Tensor],
    args: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """Check `torch.func.grad` of a scalar function against central finite differences.

    Every floating tensor leaf of `args` is cast to float64 and differentiated; other leaves are
    passed through. Each element costs two calls of `fn`, so keep the inputs small.

    Args:
        fn: `fn(*args) -> 0-d tensor`, differentiable with `torch.func.grad`.
        args: a tuple of positional arguments (pytrees), or a single tensor / pytree.
        eps: finite-difference step (float64 central differences: error ~ eps**2).
        atol: absolute tolerance between analytic and numeric gradients.
        rtol: relative tolerance (relative to the numeric gradient).

    Raises:
        AssertionError: naming the argument path (`args[0].w`) of the worst element, its index,
            both gradient values and how many elements disagree.
        ValueError: `fn` does not return a 0-d tensor, or `args` has no floating tensor.

    Example:
        >>> import torch
        >>> from ember.core.testing import check_grads
        >>> check_grads(lambda p, x: (torch.tanh(x @ p["w"]) ** 2).sum(),
        ...             ({"w": torch.randn(3, 2)}, torch.randn(4, 3)))
    """
    if not isinstance(args, tuple):
        args = (args,)
    flat, treespec = tree_flatten_with_path((args, {}))
    leaves = [leaf for _, leaf in flat]
    diff_idx = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and x.is_floating_point()]
    if not diff_idx:
        raise ValueError("check_grads: `args` holds no floating tensor to differentiate.")
    differentiated = set(diff_idx)
    base = [
        x.detach().to(torch.float64) if i in differentiated else x for i, x in enumerate(leaves)
    ]

    def call(float_leaves: List[Tensor]) -> Tensor:
        full = list(base)
        for i, v in zip(diff_idx, float_leaves):
            full[i] = v
        a, kw = tree_unflatten(full, treespec)
        out = fn(*a, **kw)
        if not isinstance(out, Tensor) or out.dim() != 0:
            raise ValueError(
                f"check_grads: fn must return a 0-d tensor, got "
                f"{tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__}; "
                f"reduce it (e.g. `.sum()`)."
            )
        return out

    float_leaves = [base[i] for i in diff_idx]
    analytic = torch.func.grad(call)(float_leaves)
    with torch.no_grad():
        for k, i in enumerate(diff_idx):
            x = float_leaves[k]
            numeric = torch.empty_like(x).reshape(-1)
            for j in range(x.numel()):
                values = []
                for sign in (1.0, -1.0):
                    bumped = list(float_leaves)
                    xp = x.clone().reshape(-1)
                    xp[j] += sign * eps
                    bumped[k] = xp.reshape(x.shape)
                    values.append(call(bumped))
                numeric[j] = (values[0] - values[1]) / (2 * eps)
            got = analytic[k].reshape(-1)
            ok = torch.isclose(got, numeric, rtol=rtol, atol=atol)
            if bool(ok.all()):
                continue
            err = (got - numeric).abs().nan_to_num(nan=math.inf)
            worst = int(err.argmax())
            raise AssertionError(
                f"gradient of fn w.r.t. {_call_path(flat[i][0])} does not match finite "
                f"differences at index {_index(worst, tuple(x.shape))}: torch.func.grad gives "
                f"{got[worst].item():.8g}, finite differences {numeric[worst].item():.8g} "
                f"(abs error {err[worst].item():.3g}; {int((~ok).sum())} of {ok.numel()} elements "
                f"differ with rtol={rtol:g}, atol={atol:g}, eps={eps:g})"
            )


def _tensor_snapshot(args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    flat, _ = tree_flatten_with_path((args, kwargs))
    return [
        (path, leaf, leaf.detach().clone(), getattr(leaf, "_version", None))
        for path, leaf in flat
        if isinstance(leaf, Tensor)
    ]


def _check_untouched(snapshot, call: str) -> None:
    for path, leaf, copy, version in snapshot:
        changed_version = version is not None and getattr(leaf, "_version", None) != version
        msg = _compare_leaf(leaf, copy, rtol=0.0, atol=0.0, exact=True)
        if msg is not None or changed_version:
            detail = msg if msg is not None else "  (same values, but written in place)"
            raise AssertionError(
                f"step modified its input {_call_path(path)} in place during the {call} call; a "
                f"pure step must return new tensors (use out-of-place ops, e.g. `x + y` rather "
                f"than `x.add_(y)`):\n{detail}"
            )


def assert_pure(step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Assert `step(*args, **kwargs)` is pure: repeatable bit for bit, inputs left unchanged.

    Calls `step` twice on the same inputs; the outputs must be bit-identical (NaNs in the same
    places count as equal) and no input tensor may change value or be written in place (its
    version counter must not move). A step with `donate="state"` is impure by design.

    Args:
        step: the function under test.
        *args: positional arguments (pytrees).
        **kwargs: keyword arguments (pytrees).

    Returns:
        The output of the first call.

    Raises:
        AssertionError: naming the input path that was modified (`args[0].params.w`), or the
            output leaf that differs between the calls.

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_pure
        >>> assert_pure(lambda s, x: s + x, torch.ones(2), torch.ones(2)).tolist()
        [2.0, 2.0]
    """
    snapshot = _tensor_snapshot(args, kwargs)
    first = step(*args, **kwargs)
    _check_untouched(snapshot, "first")
    first_copy = tree_map(lambda t: _to_cpu(t).clone() if isinstance(t, Tensor) else t, first)
    second = step(*args, **kwargs)
    _check_untouched(snapshot, "second")
    try:
        assert_trees_all_equal(tree_map(_to_cpu, second), first_copy)
    except AssertionError as e:
        raise AssertionError(
            f"step is not deterministic: two calls on the same inputs gave different outputs "
            f"(randomness must come from keys in the inputs, not the global RNG):\n{e}"
        ) from None
    return first


# ------------------------------------------------------------------------------- compile counting


def _compile_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


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
                f"graph breaks split the function (check with torch._dynamo.explain)."
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


# ---------------------------------------------------------------------------- backend comparison


def _backend_device(backend: str) -> torch.device:
    if backend != "xla":
        return torch.device("cpu")
    from . import xla

    return xla.require_torch_xla("run_on_backends(backends=(..., 'xla'))").device()


def run_on_backends(
    step: Callable[..., Tuple[Any, Any]],
    state: Any,
    batch_or_batches: Any,
    *,
    backends: Sequence[Backend] = ("eager", "inductor"),
    steps: Optional[int] = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> Dict[str, Tuple[Any, List[Any]]]:
    """Run one step function through `ember.core.jit` on several backends and compare them.

    Each backend starts from its own copy of `state` (on `torch_xla.device()` for `"xla"`) and
    runs `steps` steps; metrics of every step and the final states are brought to CPU and
    compared with the first backend's within `rtol`/`atol`.

    Args:
        step: `step(state, batch) -> (state, metrics)`, pure.
        state: the initial state (a pytree; not modified).
        batch_or_batches: one batch used for every step, or a `list` of batches used in order
            (cycled if shorter than `steps`). Any non-list (a dict, a tuple) is one batch.
        backends: backends of `ember.core.jit` to run, compared against the first one.
        steps: number of steps; defaults to the number of batches (1 for a single batch).
        rtol: relative tolerance for metrics and final states.
        atol: absolute tolerance for metrics and final states.

    Returns:
        `{backend: (final_state, [metrics of each step])}`, all on CPU.

    Raises:
        AssertionError: naming the step, both backends and the first differing leaf.
        ValueError: an unknown backend (listing the valid ones), no backends, or `steps < 1`.
        ImportError: `"xla"` requested without torch_xla installed.

    Example:
        >>> import torch
        >>> from ember.core.testing import run_on_backends
        >>> def step(state, batch):
        ...     new = {"w": state["w"] - 0.1 * batch}
        ...     return new, {"w_norm": new["w"].norm()}
        >>> out = run_on_backends(step, {"w": torch.ones(2)}, torch.ones(2), backends=("eager",))
        >>> out["eager"][1][0]["w_norm"].item() == torch.full((2,), 0.9).norm().item()
        True
    """
    from .jit import jit

    backends = tuple(backends)
    if not backends:
        raise ValueError(f"run_on_backends: backends is empty; choose from {list(_BACKENDS)}.")
    unknown = [b for b in backends if b not in _BACKENDS]
    if unknown:
        raise ValueError(
            f"run_on_backends: unknown backend(s) {unknown}; valid choices: {list(_BACKENDS)}."
        )
    batches = batch_or_batches if isinstance(batch_or_batches, list) else [batch_or_batches]
    if not batches:
        raise ValueError("run_on_backends: the list of batches is empty.")
    steps = len(batches) if steps is None else steps
    if steps < 1:
        raise ValueError(f"run_on_backends: steps must be >= 1, got {steps}.")

    def to(tree: PyTree, device: torch.device) -> PyTree:
        return tree_map(lambda t: t.detach().clone().to(device) if isinstance(t, Tensor) else t, tree)

    # Start every device first: autograd sizes its device queues at the first backward pass, so
    # an eager step that ran before the torch_xla runtime started breaks backward on XLA.
    devices = {backend: _backend_device(backend) for backend in backends}
    results: Dict[str, Tuple[Any, List[Any]]] = {}
    for backend in backends:
        device = devices[backend]
        fn = jit(step, backend=backend)
        current = to(state, device)
        trajectory = []
        for i in range(steps):
            current, metrics = fn(current, to(batches[i % len(batches)], device))
            trajectory.append(tree_map(_to_cpu, metrics))  # host sync: a test helper, not a step
        results[backend] = (tree_map(_to_cpu, current), trajectory)

    ref = backends[0]
    for backend in backends[1:]:
        for i in range(steps):
            _compare_labelled(
                results[ref][1][i], results[backend][1][i], rtol, atol,
                f"metrics of step {i} differ between backend '{backend}' and '{ref}'",
            )
        _compare_labelled(
            results[ref][0], results[backend][0], rtol, atol,
            f"final states after {steps} steps differ between backend '{backend}' and '{ref}'",
        )
    return results


def _compare_labelled(ref: PyTree, got: PyTree, rtol: float, atol: float, label: str) -> None:
    try:
        assert_trees_all_close(got, ref, rtol=rtol, atol=atol)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


# ------------------------------------------------------------------------------------- typing


def typechecked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Check jaxtyping annotations with beartype in eager mode; skip checks under torch.compile.

    jaxtyping + beartype checks fail under `torch.compile` (and give false errors without
    `fullgraph`), so the wrapper calls `fn` unchecked while `torch.compiler.is_compiling()`.

    Args:
        fn: a function annotated with jaxtyping types, e.g. `Float[torch.Tensor, "b t d"]`.

    Returns:
        The wrapped function.

    Raises:
        jaxtyping.TypeCheckError: (a `TypeError`, when called eagerly) an argument or the return
            value does not match its annotation, shapes included.

    Example:
        >>> import torch
        >>> from jaxtyping import Float
        >>> from ember.core.testing import typechecked
        >>> @typechecked
        ... def attend(q: Float[torch.Tensor, "b t d"], k: Float[torch.Tensor, "b s d"]
        ...            ) -> Float[torch.Tensor, "b t s"]:
        ...     return q @ k.transpose(1, 2)   # (b, t, d) @ (b, d, s) -> (b, t, s)
        >>> attend(torch.ones(2, 3, 4), torch.ones(2, 5, 4)).shape
        torch.Size([2, 3, 5])
        >>> try:
        ...     attend(torch.ones(2, 3, 4), torch.ones(2, 5, 8))
        ... except TypeError as e:
        ...     print(type(e).__name__)
        TypeCheckError
    """
    from beartype import beartype
    from jaxtyping import jaxtyped

    checked = jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return checked(*args, **kwargs)

    return wrapper
