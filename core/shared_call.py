"""`shared_call`: call a pytree function so that repeated calls compile once in ember's Inductor step.

`shared_call(fn, name, *args)` is `fn(*args)`. Inside `jit(backend="inductor")`, every call with
the same `name`, argument structure, tensor shapes/strides/dtypes and non-tensor leaves becomes one
node of a single shared subgraph (`compat/shared_subgraph.py`), which Inductor compiles once: a
loop over 16 microbatches or 24 layers costs one body's compile instead of 16 or 24. Eagerly, on
XLA, under Dynamo, under `vmap` and with DTensor arguments it is a plain call (torch's
`invoke_subgraph` has no DTensor rule: "There was no rule registered for HOP invoke_subgraph and
subclass DTensor", torch 2.15). `fn` must be pure (the traced body is reused
for every call), and must not depend on Python objects other than its arguments' non-tensor
leaves, which are part of the key.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List, Tuple

from torch import Tensor

from .compat.shared_subgraph import call_shared, function_index
from .local_shards import has_dtensor
from .pytree import tree_flatten, tree_unflatten
from .trace_context import here, loop_body

__all__ = ["shared_call"]

_SIMPLE = (type(None), bool, int, float, str, complex)
_OUTPUTS: Dict[str, Tuple[Any, Tuple[Any, ...]]] = {}  # identifier -> (out spec, leaf kinds)


def _key_part(leaf: Any) -> Any:
    """A stable description of a leaf for the identifier, or None when it cannot be keyed safely."""
    if isinstance(leaf, Tensor):
        return ("T", tuple(leaf.shape), leaf.stride(), str(leaf.dtype), str(leaf.device))
    if isinstance(leaf, _SIMPLE) or type(leaf).__name__ == "dtype":
        return ("C", repr(leaf))
    return None


def shared_call(fn: Callable[..., Any], name: str, *args: Any) -> Any:
    """`fn(*args)`; in ember's compiled step, one compiled subgraph for every call with this key.

    Args:
        fn: a pure function of pytrees; it may return any pytree.
        name: identifies `fn`: calls of different functions must use different names.
        *args: pytrees of tensors and simple constants (None, bool, int, float, str, dtype).

    Returns:
        What `fn(*args)` returns.
    """
    if not here().shares:
        return fn(*args)
    leaves, spec = tree_flatten(args)
    if has_dtensor(leaves):
        return fn(*args)
    parts = [_key_part(x) for x in leaves]
    spec_text = repr(spec)
    if any(p is None for p in parts) or " at 0x" in spec_text:
        return fn(*args)  # an object keyed by identity could be reused by another call: do not share
    # The identifier is part of the graph, so it must not vary between processes (Inductor's cache
    # keys on it): the function's rank among those sharing `name` in this trace, and a digest.
    digest = hashlib.sha1(repr((spec_text, parts)).encode()).hexdigest()[:16]
    identifier = f"{name}#{function_index(fn, name)}:{digest}"
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]

    def flat(*tensors: Tensor) -> Tuple[Tensor, ...]:
        with loop_body():  # another shared subgraph would nest in this one's body
            return _flat(*tensors)

    def _flat(*tensors: Tensor) -> Tuple[Tensor, ...]:
        full = list(leaves)
        for i, t in zip(tensor_pos, tensors):
            full[i] = t
        out_leaves, out_spec = tree_flatten(fn(*tree_unflatten(full, spec)))
        inputs = {id(t) for t in tensors}
        graph_out: List[Tensor] = []
        kinds: List[Any] = []
        for leaf in out_leaves:
            if isinstance(leaf, Tensor):
                kinds.append(("T", len(graph_out)))
                # the shared subgraph may not return its own input: hand back a copy
                graph_out.append(leaf.clone() if id(leaf) in inputs else leaf)
            else:
                kinds.append(("C", leaf))
        _OUTPUTS[identifier] = (out_spec, tuple(kinds))
        return tuple(graph_out)

    results = call_shared(flat, identifier, [leaves[i] for i in tensor_pos])
    out_spec, kinds = _OUTPUTS[identifier]
    return tree_unflatten([results[v] if k == "T" else v for k, v in kinds], out_spec)
