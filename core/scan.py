"""Loops over the leading dimension of pytrees: `scan`, and stacking trees into one.

Public names: `scan`, `rolled_sum`, `stack_trees`, `unstack_trees` (also exported from
`ember.core.transforms`).

`scan(f, init, xs)` is `jax.lax.scan`: it threads a carry through `f(carry, x) -> (carry, y)`
for each slice `x` of `xs` along dim 0 and stacks the `y`s (`reverse=True` walks from the end and
still stacks `ys[i]` from `xs[i]`, as JAX does). The typical use is a stack of
identical layers whose parameters are stored stacked (`stack_trees(per_layer_params)`, each leaf
with a leading `n_layers` dim), applied by scanning the block over them.

Inside `jit(backend="inductor")`'s trace `scan` rolls: one node of torch's `scan` operator runs the
step, and its gradient is one more walking back, recomputing each step from the carry it started from
(`scan_rolled.py`), so compile time does not grow with the length. As in JAX, the body is traced once
(its Python runs at trace time) and what it closes over enters the loop, gradients included. It rolls on
plain tensors and on DTensors (the loop runs on their local shards, the body's collectives inside it) outside
`torch.func` transforms when `unroll` is below the length; elsewhere (eagerly, under Dynamo, `vmap`, torch_xla, a
DTensor stack split along its first dim) it is a Python loop, the same numbers. For a stack of rematerialised
layers, `remat_scan` keeps the kept activations per layer.

Example:
    >>> import torch
    >>> from ember.core.transforms import scan
    >>> def cumsum(carry, x):
    ...     carry = carry + x
    ...     return carry, carry
    >>> total, partial = scan(cumsum, torch.tensor(0.0), torch.arange(4.0))
    >>> float(total), partial.tolist()
    (6.0, [0.0, 1.0, 3.0, 6.0])
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .compat.functorch import functorch_base
from .compat.xla_loop import xla_fold
from .local_shards import is_dtensor
from .pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten
from .scan_rolled import rolled_scan
from .trace_context import FunctionError, here, xla_loop_body
from .types import PyTree

__all__ = ["rolled_sum", "rolls_in_the_graph", "scan", "stack_trees", "unstack_trees", "xla_loop_possible"]


def _leading_dim(tree: PyTree, *, what: str) -> Optional[int]:
    """The common leading dim of every leaf of `tree` (None if it has no leaves)."""
    leaves, _ = tree_flatten_with_path(tree)
    n: Optional[int] = None
    first = ""
    for path, leaf in leaves:
        if leaf is None:  # torch's pytree keeps None as a leaf; JAX treats it as empty
            continue
        name = keystr(path) or "<root>"
        if not isinstance(leaf, Tensor):
            raise TypeError(
                f"every leaf of {what} must be a tensor; {what}.{name} is a {type(leaf).__name__}. "
                "Keep non-tensor values out of the scanned tree (close over them instead)."
            )
        if leaf.dim() == 0:
            raise ValueError(
                f"{what}.{name} is 0-d, but every leaf needs a leading dim to slice over; "
                "give it shape (length, ...)."
            )
        if n is None:
            n, first = leaf.shape[0], name
        elif leaf.shape[0] != n:
            raise ValueError(
                f"every leaf of {what} must have the same leading dim: {what}.{first} has "
                f"{n} but {what}.{name} has {leaf.shape[0]} (shape {tuple(leaf.shape)})."
            )
    return n


def _unstack(tree: PyTree, n: int) -> List[PyTree]:
    leaves, spec = tree_flatten(tree)
    wrapped = here().transform  # a leaf may be a DTensor under a torch.func transform's wrapper
    slices = [_slices(leaf, n, wrapped) for leaf in leaves]
    return [tree_unflatten([s[i] for s in slices], spec) for i in range(n)]


def _slices(leaf: Optional[Tensor], n: int, wrapped: bool) -> Sequence[Optional[Tensor]]:
    """`leaf`'s n slices along dim 0 by `unbind`, whose gradient is one stack (n `select`s' are n zero-filled leaves
    summed). A DTensor, bare or under a `torch.func` transform's wrapper, is selected: torch 2.9's DTensor has no
    rule for `unbind` (a DTensor's microbatches)."""
    if leaf is None:
        return (None,) * n
    return [leaf[i] for i in range(n)] if is_dtensor(functorch_base(leaf) if wrapped else leaf) else leaf.unbind(0)


def _leaf_signature(v: Any) -> Any:
    return (tuple(v.shape), v.dtype) if isinstance(v, Tensor) else type(v)


def _signature(tree: PyTree) -> Tuple[Any, List[Tuple[str, Any]]]:
    leaves, spec = tree_flatten_with_path(tree)
    return spec, [(keystr(p), _leaf_signature(v)) for p, v in leaves]


def _check_carry(init_sig: Tuple[Any, List[Tuple[str, Any]]], carry: PyTree, step: int) -> None:
    leaves, spec = tree_flatten(carry)
    if spec == init_sig[0] and all(_leaf_signature(v) == want for v, (_, want) in zip(leaves, init_sig[1])):
        return  # the carry kept its signature; the paths are named only when it did not
    spec, sig = _signature(carry)
    if spec != init_sig[0]:
        raise FunctionError(
            f"scan: the carry returned at step {step} has a different structure from `init`:\n"
            f"  init:  {init_sig[0]}\n  carry: {spec}\n"
            "`f` must return `(carry, y)` with carry shaped exactly like `init`."
        )
    for (path, want), (_, got) in zip(init_sig[1], sig):
        if want != got:
            raise FunctionError(
                f"scan: carry leaf '{path or '<root>'}' changed at step {step}: `init` has "
                f"{want}, `f` returned {got}. The carry must keep its shape and dtype; cast or "
                "reshape inside `f`, or change `init` to match."
            )


def scan(
    f: Callable[[PyTree, PyTree], Tuple[PyTree, PyTree]],
    init: PyTree,
    xs: PyTree,
    *,
    length: Optional[int] = None,
    reverse: bool = False,
    unroll: Union[int, bool] = 1,
) -> Tuple[PyTree, PyTree]:
    """Loop `f(carry, x) -> (carry, y)` over dim 0 of `xs`; return the final carry and stacked ys.

    Equivalent to::

        carry = init
        for i in range(length):
            carry, y_i = f(carry, tree_map(lambda l: l[i], xs))
        return carry, stack_trees([y_0, ..., y_{length-1}])

    Works under `grad`, `vmap` and `torch.compile(fullgraph=True)`, where it unrolls; rolls inside
    ember's Inductor trace (module docstring).

    Args:
        f: the step function. `carry` keeps the structure, shapes and dtypes of `init`; `y` is any
            pytree of tensors with the same structure every step, or None.
        init: the initial carry (a pytree).
        xs: a pytree whose tensor leaves share a leading dim of size `length` (None leaves are
            passed to `f` as None), or None.
        length: number of steps; required when `xs` has no leaves, else must match.
        reverse: run from the last slice to the first; `ys` stay in the order of `xs`
            (`ys[i]` comes from `xs[i]`), as in `jax.lax.scan`.
        unroll: JAX's loop-unrolling hint (a bool or an int >= 0; JAX's default is 1). It never
            changes the results: `True` or the length or more unrolls every step into the graph,
            any other value rolls one step per iteration where `scan` rolls.

    Returns:
        `(carry, ys)`: the final carry and the `y`s stacked along a new dim 0 (None if `f`
        returned None for y).

    Raises:
        TypeError: a leaf of `xs` is not a tensor.
        ValueError: leading dims differ (the message names both leaves), `length` disagrees with
            `xs` or is missing, `length` is 0, the carry changes structure, shape or dtype, or
            `unroll` is a negative int.

    Example:
        >>> import torch
        >>> from ember.core.transforms import scan, stack_trees
        >>> layers = stack_trees([{"w": torch.full((2, 2), float(i))} for i in range(3)])
        >>> h, _ = scan(lambda h, p: (h @ p["w"], None), torch.ones(1, 2), layers)
        >>> h.tolist()
        [[0.0, 0.0]]
    """
    if not isinstance(unroll, (bool, int)):
        raise TypeError(
            f"scan(unroll=...) must be a bool or an int >= 0 (JAX's hint), got {type(unroll).__name__} {unroll!r}."
        )
    if unroll < 0:
        raise ValueError(f"scan(unroll={unroll}) must be a bool or an int >= 0, as in jax.lax.scan.")
    if not isinstance(reverse, bool):
        raise TypeError(f"scan(reverse=...) must be a bool, got {type(reverse).__name__} {reverse!r}.")
    n = _leading_dim(xs, what="xs")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
        raise TypeError(f"length must be an int or None, got {length!r}.")
    if n is None:
        if length is None:
            raise ValueError("scan: `xs` has no tensor leaves, so pass length=<number of steps>.")
        n = length
    elif length is not None and length != n:
        raise ValueError(f"scan: length={length} but the leaves of `xs` have leading dim {n}.")
    if n == 0:
        raise ValueError(
            "scan over 0 steps: the structure of ys is unknown without running `f`; "
            "handle the empty case before calling scan."
        )
    if rolls_in_the_graph(init, xs, n, unroll):
        rolled = rolled_scan(lambda c, x, _: f(c, x), init, xs, n, reverse)
        if rolled is not None:
            return rolled
    init_sig = _signature(init)
    slices = _unstack(xs, n)
    order = range(n - 1, -1, -1) if reverse else range(n)
    carry, ys = init, [None] * n
    for i in order:
        carry, y = f(carry, slices[i])
        _check_carry(init_sig, carry, i)
        ys[i] = y
    if all(y is None for y in ys):
        return carry, None
    return carry, stack_trees(ys, what="scan ys")


def rolls_in_the_graph(init: PyTree, xs: PyTree, n: int, unroll: Union[int, bool] = False) -> bool:
    """Whether this call runs inside ember's Inductor trace, on plain tensors or DTensors, rolled (module docstring)."""
    if unroll is True or unroll >= n or n < 2:
        return False
    if not here().ember_traced:
        return False
    leaves = [t for t in (*tree_flatten(init)[0], *tree_flatten(xs)[0]) if t is not None]
    return all(isinstance(t, Tensor) and t.device.type != "xla" for t in leaves)


def xla_loop_possible(tensors: Sequence[Tensor]) -> bool:
    """Whether a loop over `tensors` can be an XLA `While` here: all on torch_xla, no DTensor, under
    no `torch.func` transform, and not inside another XLA loop's body."""
    # len, not bool: torch 2.9's Dynamo cannot trace bool() of a list (a user's torch.compile of a step)
    return (len(tensors) > 0 and all(t.device.type == "xla" and not is_dtensor(t) for t in tensors)
            and not (here().transform or here().in_xla_loop))


def rolled_sum(fn: Callable[[PyTree, PyTree], PyTree], consts: PyTree, xs: PyTree) -> PyTree:
    """`sum(fn(consts, x) for x in slices of xs along dim 0)`, leaf by leaf: a `scan` whose carry is the sum.

    Where `scan` rolls (ember's Inductor step) the sum starts from zeros and the step's graph holds
    `fn` once, whatever the length; on torch_xla the first slice is added to the rest by one XLA
    `While`; elsewhere the first slice's result is added to the rest's one by one. Non-tensor leaves of
    `fn`'s result (a `None`) must be the same every call.

    Args:
        fn: a pure function of `(consts, x)` returning a pytree of tensors.
        consts: what every call sees (parameters).
        xs: pytrees of tensors sliced along their leading dim (microbatches, their keys).

    Example:
        >>> import torch
        >>> from ember.core.transforms import rolled_sum
        >>> rolled_sum(lambda w, x: {"y": w * x}, torch.tensor(2.0), torch.arange(4.0))["y"].item()
        12.0
    """
    n = _leading_dim(xs, what="xs")
    if n is None:
        raise ValueError("rolled_sum: `xs` has no tensor leaves: give it the slices to sum over.")
    first = fn(consts, tree_map(lambda t: t if t is None else t[0], xs))
    add = lambda total, x: (_add(total, fn(consts, x)), None)  # noqa: E731
    tensors = [t for t in (*tree_flatten(consts)[0], *tree_flatten(xs)[0]) if isinstance(t, Tensor)]
    if n > 1 and rolls_in_the_graph(tensors, xs, n, 1):  # `first` only gives the shapes: dead code in the graph
        return scan(add, tree_map(lambda t: torch.zeros_like(t) if isinstance(t, Tensor) else t, first), xs)[0]
    if n == 1:
        return first
    rest = tree_map(lambda t: t if t is None else t[1:], xs)
    if xla_loop_possible(tensors):
        folded = xla_fold(xla_loop_body(lambda total, x: add(total, x)[0]), first, rest)
        if folded is not None:
            return folded
    return scan(add, first, rest, unroll=True)[0]


def _add(total: PyTree, new: PyTree) -> PyTree:
    leaves, spec = tree_flatten(total)
    added = tree_flatten(new)[0]
    return tree_unflatten([a + b if isinstance(a, Tensor) else a for a, b in zip(leaves, added)], spec)


def stack_trees(trees: Sequence[PyTree], *, what: str = "trees", fix: str = "Every tree must match.") -> PyTree:
    """Stack a list of same-structured pytrees leaf by leaf along a new dim 0.

    Args:
        trees: a non-empty list of pytrees with the same structure, shapes and dtypes
            (e.g. the params of each layer). A leaf that is None in every tree stays None.
        what: how to name the trees in error messages.
        fix: the sentence that ends a mismatch error (what the caller can do instead).

    Returns:
        One pytree whose leaves have shape `(len(trees), *leaf.shape)`.

    Raises:
        ValueError: `trees` is empty, or the trees differ in structure or in a leaf's shape
            (the message names the tree index and the leaf path).
        TypeError: `trees` is not a list or tuple, or a leaf is not a tensor.

    Example:
        >>> import torch
        >>> from ember.core.transforms import stack_trees
        >>> stack_trees([{"w": torch.zeros(3)}, {"w": torch.ones(3)}])["w"].shape
        torch.Size([2, 3])
    """
    if not isinstance(trees, (list, tuple)):
        raise TypeError(f"{what} must be a list or tuple of pytrees, got {type(trees).__name__}.")
    if len(trees) == 0:
        raise ValueError(f"cannot stack an empty list of {what}: pass at least one tree.")
    first, spec = tree_flatten_with_path(trees[0])
    columns: List[List[Tensor]] = [[] for _ in first]
    for k, tree in enumerate(trees):
        leaves, spec_k = tree_flatten_with_path(tree)
        if spec_k != spec:
            raise ValueError(
                f"{what}[{k}] has a different structure from {what}[0]:\n"
                f"  {what}[0]: {spec}\n  {what}[{k}]: {spec_k}\n{fix}"
            )
        for j, ((path, leaf), (_, ref)) in enumerate(zip(leaves, first)):
            name = keystr(path) or "<root>"
            if leaf is None and ref is None:  # None leaves stay None (e.g. an unused y part)
                continue
            if not isinstance(leaf, Tensor) or not isinstance(ref, Tensor):
                bad, idx = (leaf, k) if not isinstance(leaf, Tensor) else (ref, 0)
                raise TypeError(f"{what}[{idx}].{name} is a {type(bad).__name__}, not a tensor.")
            if leaf.shape != ref.shape or leaf.dtype != ref.dtype:
                raise ValueError(
                    f"cannot stack {what}: leaf '{name}' is {tuple(ref.shape)} {ref.dtype} in "
                    f"{what}[0] but {tuple(leaf.shape)} {leaf.dtype} in {what}[{k}]. {fix}"
                )
            columns[j].append(leaf)
    return tree_unflatten([torch.stack(col) if col else None for col in columns], spec)


def unstack_trees(tree: PyTree) -> List[PyTree]:
    """Split a pytree along dim 0 of every leaf into a list of pytrees (inverse of `stack_trees`).

    Args:
        tree: a pytree whose tensor leaves share a leading dim `n` (None leaves stay None).

    Returns:
        A list of `n` pytrees; the i-th holds `leaf[i]` for every leaf (views, no copies).

    Raises:
        TypeError: a leaf is not a tensor.
        ValueError: a leaf is 0-d, the leading dims differ, or the tree has no leaves.

    Example:
        >>> import torch
        >>> from ember.core.transforms import unstack_trees
        >>> [t["w"].tolist() for t in unstack_trees({"w": torch.tensor([1.0, 2.0])})]
        [1.0, 2.0]
    """
    n = _leading_dim(tree, what="tree")
    if n is None:
        raise ValueError("cannot unstack a tree with no tensor leaves: its length is unknown.")
    return _unstack(tree, n)
