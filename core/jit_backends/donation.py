"""Donation: the traced entry writes the new state into the donated state's own tensors.

`make_entry(fn, donate)` returns the function every backend traces or runs: `fn`, plus (with
`donate="state"`) one `copy_` per leaf from the new state into the donated one (none where the new
leaf is the donated tensor itself), decided on static metadata only, so it costs nothing per call
once compiled. The entry returns `(out, ok)`; `ok` is False when the output cannot be donated, and
`donation_error` then says precisely why.
"""

from __future__ import annotations

import types
from typing import Any, Callable, List, Optional, Tuple

from torch import Tensor

from ..pytree import keystr, tree_flatten, tree_flatten_with_path, tree_leaves

__all__ = ["donation_error", "make_entry", "short_repr", "with_first"]


_MSG_BAD_OUTPUT = (
    "jit(donate='state') expects fn to return a tuple or list whose first element is the new "
    "state, e.g. `return new_state, metrics`, got {got}. Return `(new_state, ...)`, or use "
    "donate='none'."
)
_MSG_SHAPE_CHANGED = (
    "jit(donate='state') cannot donate state leaf '{path}': its new value must fit the donated "
    "buffer, but {what} changed from {old} to {new}. Keep every state leaf's shape and dtype "
    "fixed across steps (cast back, e.g. `.to(old.dtype)`), or use donate='none'."
)


def short_repr(obj: Any, n: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= n else text[: n - 3] + "..."


def with_first(out: Any, first: Any) -> Any:
    """`out` with its first element replaced (tuple, list or NamedTuple)."""
    if isinstance(out, list):
        return [first, *out[1:]]
    if hasattr(out, "_replace"):  # NamedTuple
        return out._replace(**{out._fields[0]: first})
    return (first, *out[1:])


def _donatable(state: Any, out: Any) -> bool:
    """Whether `out[0]` can be copied into `state` leaf by leaf (static metadata only)."""
    if not isinstance(out, (tuple, list)) or len(out) == 0:
        return False
    old, old_spec = tree_flatten(state)
    new, new_spec = tree_flatten(out[0])
    if old_spec != new_spec:
        return False
    for o, n in zip(old, new):
        if not (isinstance(o, Tensor) and isinstance(n, Tensor)):
            return False
        if o.shape != n.shape or o.dtype != n.dtype or o.device != n.device:
            return False
    return _moved_leaf(old, new) is None


def _moved_leaf(old: List[Any], new: List[Any]) -> Optional[Tuple[int, int]]:
    """`(i, j)` if new leaf `i` *is* donated leaf `j != i` (a leaf moved or swapped), else None.

    Copying leaf by leaf would then read donated leaf `j` after it was overwritten. A dict keyed by
    the tensors (identity hashing) finds this in O(n) and traces under Dynamo. A leaf returned
    unchanged at its own position is fine (a no-op copy).
    """
    position = {t: i for i, t in enumerate(old)}
    for i, n in enumerate(new):
        j = position.get(n, i)
        if j != i:
            return i, j
    return None


def make_entry(fn: Callable, donate: str) -> Callable[..., Tuple[Any, bool]]:
    """The function every backend runs: `fn`, plus the in-place copy into the donated state."""
    if donate == "none":

        def entry(*args: Any, **kwargs: Any) -> Tuple[Any, bool]:
            return fn(*args, **kwargs), True

    else:

        def entry(state: Any, *args: Any, **kwargs: Any) -> Tuple[Any, bool]:
            out = fn(state, *args, **kwargs)
            if not _donatable(state, out):
                return out, False  # the front door raises the precise error; the state is untouched
            # One copy_ per leaf, not torch._foreach_copy_: Inductor (CPU) orders a fused foreach
            # copy into graph inputs wrongly when a new leaf reads another donated leaf (Adam's
            # param update reading m and v written first); per-leaf copies are right.
            for dst, src in zip(tree_leaves(state), tree_leaves(out[0])):
                if src is not dst:  # a leaf returned as it came
                    dst.copy_(src)
            return with_first(out, state), True

    name = "ember_jit_" + "".join(c if c.isalnum() else "_" for c in getattr(fn, "__name__", "fn"))
    # A code object of its own: Dynamo keeps graphs (and counts recompiles) per code object, so
    # two jits of the same function must not share them.
    code = entry.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, entry.__globals__, name, entry.__defaults__, entry.__closure__)


def donation_error(state: Any, out: Any) -> Exception:
    """The precise error for an output the entry could not donate (runs eagerly, on the error path)."""
    if not isinstance(out, (tuple, list)) or len(out) == 0:
        return TypeError(_MSG_BAD_OUTPUT.format(got=f"{type(out).__name__} {short_repr(out)}"))
    old, old_spec = tree_flatten_with_path(state)
    new, new_spec = tree_flatten_with_path(out[0])
    if old_spec != new_spec:
        old_paths, new_paths = [keystr(p) for p, _ in old], [keystr(p) for p, _ in new]
        gone = sorted(set(old_paths) - set(new_paths))[:5]
        added = sorted(set(new_paths) - set(old_paths))[:5]
        detail = (
            f"paths missing from the new state: {gone}; new paths: {added}"
            if gone or added
            else f"same paths but different containers or static fields:\n  {old_spec}\nvs\n  {new_spec}"
        )
        return ValueError(
            f"jit(donate='state') needs the new state (first output) to have the same pytree "
            f"structure as the donated state: {detail}. Return a state built with `.replace(...)` "
            f"from the input state, or use donate='none'."
        )
    for (path, o), (_, n) in zip(old, new):
        p = keystr(path)
        for leaf, which in ((o, "donated"), (n, "new")):
            if not isinstance(leaf, Tensor):
                return TypeError(
                    f"jit(donate='state') can only donate tensors, but the {which} state's leaf "
                    f"'{p}' is a {type(leaf).__name__} ({short_repr(leaf)}). Make it a tensor (e.g. "
                    f"torch.tensor(x)) or a static field (`pytree.field(static=True)`), or use "
                    f"donate='none'."
                )
        for what, a, b in (("shape", tuple(o.shape), tuple(n.shape)), ("dtype", o.dtype, n.dtype),
                           ("device", o.device, n.device)):
            if a != b:
                return ValueError(_MSG_SHAPE_CHANGED.format(path=p, what=what, old=a, new=b))
    moved = _moved_leaf([o for _, o in old], [n for _, n in new])
    if moved is not None:
        i, j = moved
        return ValueError(
            f"jit(donate='state') cannot donate: the new state's leaf '{keystr(new[i][0])}' is the "
            f"donated leaf '{keystr(old[j][0])}' itself (a leaf moved to another position). The "
            f"donated buffers are overwritten leaf by leaf, so it would read an overwritten buffer. "
            f"Use donate='none' for this function."
        )
    raise AssertionError("internal: the entry rejected an output that donation_error accepts")
