"""Leaf and device helpers and the tree comparison behind the `ember.core.testing` assertions.

No public names: `_compare_trees` and `_structure_diff` back the tree assertions; `_to_cpu`,
`_leaves`, `_as_tensor`, `_index` and `_call_path` are shared by the other testing modules.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from ..pytree import keystr, tree_flatten_with_path
from ..types import PyTree

_MAX_LISTED = 10


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
