"""Pytree assertions: closeness, exact equality and equal structure.

Public names: `assert_trees_all_close` (alias `assert_trees_close`), `assert_trees_all_equal`,
`assert_trees_all_equal_structs`.
"""

from __future__ import annotations

from ..types import PyTree
from ._compare import _compare_trees, _structure_diff


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
