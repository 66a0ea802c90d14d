"""Shape, dtype and finiteness assertions on tensors and pytrees.

Public names: `assert_shape`, `assert_tree_shapes`, `assert_tree_dtypes`, `assert_tree_all_finite`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple

import torch
from torch import Tensor

from ..types import PyTree
from ._compare import _MAX_LISTED, _as_tensor, _dtype, _index, _leaves, _name, _shape


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
