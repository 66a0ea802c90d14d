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

from ._backends import run_on_backends as run_on_backends
from ._compiles import assert_max_compiles as assert_max_compiles
from ._functions import assert_pure as assert_pure
from ._functions import check_grads as check_grads
from ._shapes import assert_shape as assert_shape
from ._shapes import assert_tree_all_finite as assert_tree_all_finite
from ._shapes import assert_tree_dtypes as assert_tree_dtypes
from ._shapes import assert_tree_shapes as assert_tree_shapes
from ._trees import assert_trees_all_close as assert_trees_all_close
from ._trees import assert_trees_all_equal as assert_trees_all_equal
from ._trees import assert_trees_all_equal_structs as assert_trees_all_equal_structs
from ._trees import assert_trees_close as assert_trees_close
from ._typing import typechecked as typechecked

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

# doctest.testmod(ember.core.testing) finds only objects defined in this module; list the
# re-exported functions so their examples run when the package is tested as one module.
__test__ = {name: globals()[name] for name in __all__}
