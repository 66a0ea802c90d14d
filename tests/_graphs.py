"""`scan_nodes`, `scan_outputs`, `traced`: the graph ember's Inductor step traces for a function, and its `scan` nodes."""

from __future__ import annotations

from typing import Any, Callable, List

import torch

from ember.core.jit_backends.trace import trace_and_compile


def scan_nodes(fn: Callable[..., Any], *args: Any) -> int:
    """Trace `fn(*args)` (pytrees of tensors and plain values) as `jit(backend="inductor")` traces a step,
    without compiling it, and count the `scan` nodes of its graph (a rolled loop is one each way)."""
    return len(scan_outputs(fn, *args))


def scan_outputs(fn: Callable[..., Any], *args: Any) -> List[int]:
    """How many tensors each `scan` node of `fn`'s traced graph returns (its last carry, then its stacked ys),
    in the graph's order (a forward loop before its backward)."""
    return [len(node.meta["val"]) for node in traced(fn, *args).graph.nodes
            if node.op == "call_function" and str(node.target) == "scan"]


def traced(fn: Callable[..., Any], *args: Any) -> torch.fx.GraphModule:
    """`fn(*args)` traced as `jit(backend="inductor")` traces a step (its tensors as flat inputs), not compiled."""
    leaves, spec = torch.utils._pytree.tree_flatten(args)
    at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]

    def flat(*tensors: torch.Tensor) -> list:
        filled = list(leaves)
        for i, t in zip(at, tensors):
            filled[i] = t
        out = fn(*torch.utils._pytree.tree_unflatten(filled, spec))
        return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]

    return trace_and_compile(flat, [leaves[i] for i in at])
