"""Gradients taken with `torch.autograd.grad` on fresh leaves made inside the call: pure from outside.

`ember.core.transforms.grad` / `value_and_grad` use this whenever no `torch.func` transform is
active and Dynamo is not tracing: eagerly, inside `jit(backend="inductor")`'s `make_fx` trace (the
backward is recorded into the step's graph, as torchtitan's graph trainer does, torchtitan#2561)
and on torch_xla. Unlike `torch.func.grad`, autograd's engine runs saved-tensor hooks, so
`torch.utils.checkpoint` (transformers' `gradient_checkpointing_enable()`), torch's `scan` and
`invoke_subgraph` differentiate (pytorch#169120, #172568 and PR #187316 track `torch.func.grad`).

Pure from the outside: the differentiated arguments are replaced by leaves that require grad
(detached copies at the outermost level, so nothing the caller holds is touched or retained), and
the value, aux and gradients come back detached. Nested inside another such gradient (grad of
grad), the leaves stay connected to the outer ones and the backward is recorded (`create_graph`),
so the outer gradient differentiates through the inner one.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .pytree import tree_flatten, tree_map, tree_unflatten
from .trace_context import here, inside_gradient

__all__ = ["autograd_value_and_grad", "detached_vjp", "pull_back", "run_differentiated"]


def _fresh_leaves(arg: Any, nested: bool) -> Tuple[Any, List[Tensor]]:
    leaves, spec = tree_flatten(arg)
    fresh = [t.view_as(t) if nested and t.requires_grad else t.detach().requires_grad_(True) for t in leaves]
    return tree_unflatten(fresh, spec), fresh


def _detached(tree: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def autograd_value_and_grad(fn: Callable, indices: Sequence[int], has_aux: bool,
                            args: Sequence[Any], kwargs: dict) -> Tuple[Any, List[Any]]:
    """`(out, grads)`: `fn(*args, **kwargs)` and the gradient of its loss for each of `indices`.

    `out` is the loss or `(loss, aux)`; `grads[k]` has the structure of `args[indices[k]]`, with
    zeros where the loss does not depend on a leaf (as `torch.func.grad` gives).
    """
    nested = here().gradients > 0 or any(t.requires_grad for i in indices for t in tree_flatten(args[i])[0])
    args = list(args)
    per_arg: List[Tuple[Any, List[Tensor]]] = []
    for i in indices:
        args[i], fresh = _fresh_leaves(args[i], nested)
        per_arg.append((tree_flatten(args[i])[1], fresh))
    with inside_gradient(), torch.enable_grad():
        out = fn(*args, **kwargs)
        loss = out[0] if has_aux else out
        inputs = [t for _, fresh in per_arg for t in fresh]
        if loss.requires_grad:
            found = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True,
                                        create_graph=nested)
        else:  # the loss does not depend on the differentiated arguments at all
            found = tuple(torch.zeros_like(t) for t in inputs)
    grads, start = [], 0
    for spec, fresh in per_arg:
        grads.append(tree_unflatten(list(found[start:start + len(fresh)]), spec))
        start += len(fresh)
    if not nested:
        out, grads = _detached(out), _detached(grads)
    return out, grads


def _inputs_for(primals: Sequence[Tensor], create_graph: bool) -> List[Tensor]:
    """Leaves that require grad standing for `primals`; connected to them when recording (`create_graph`)."""
    return [p.view_as(p) if create_graph and p.requires_grad else p.detach().requires_grad_(True) for p in primals]


def run_differentiated(fn: Callable[..., Any], primals: Sequence[Tensor]) -> Any:
    """`fn(*primals)` run as a backward would run it (inputs that require grad), results detached.

    An op's decomposition may depend on whether its inputs are differentiated (SDPA, matmul): a
    forward that records results for `pull_back` to replay must see the ops the backward will.
    """
    with torch.enable_grad():
        out = fn(*_inputs_for(primals, create_graph=False))
    return _detached(out)


def pull_back(fn: Callable[..., Sequence[Tensor]], primals: Sequence[Tensor],
              cotangents: Sequence[Optional[Tensor]]) -> List[Tensor]:
    """The gradient of `sum_j <fn(*primals)[j], cotangents[j]>` for each primal, by `torch.autograd.grad`.

    The vector-Jacobian product a recomputing backward (remat) takes: `fn` runs again here on
    leaves standing for `primals`. A `None` cotangent, or an output that does not depend on the
    primals, contributes nothing; a primal nothing depends on gets zeros. Under grad mode (a backward
    run with `create_graph`, grad of grad) the result is recorded and differentiable in turn.
    """
    create = torch.is_grad_enabled()
    inputs = _inputs_for(primals, create)
    with torch.enable_grad():
        outs = fn(*inputs)
    pairs = [(o, g) for o, g in zip(outs, cotangents) if g is not None and o.requires_grad]
    if not pairs:
        return [torch.zeros_like(p) for p in primals]
    return list(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True,
                                    materialize_grads=True, create_graph=create))


def detached_vjp(fn: Callable[..., Tensor], *primals: Any) -> Tuple[Tensor, Callable[[Tensor], Tuple[Any, ...]]]:
    """`(out, pull)` as `torch.func.vjp(fn, *primals)` gives them, with the primals' history cut off.

    `out` is `fn(*primals)` detached; `pull(cotangent)` the gradient of `<out, cotangent>` for each
    primal (pytrees like them; zeros where `out` does not depend on a leaf), once. Taken by
    `torch.autograd.grad` on fresh leaves, the engine of ember's `grad`; inside a `torch.func`
    transform or under Dynamo by `torch.func.vjp`, which composes there.
    """
    if here().torch_func:
        return torch.func.vjp(fn, *_detached(primals))
    trees, leaves = [], []
    for primal in primals:
        flat, spec = tree_flatten(primal)
        fresh = [t.detach().requires_grad_(True) if isinstance(t, Tensor) and t.is_floating_point() else t
                 for t in flat]
        trees.append((spec, fresh))
        leaves += [t for t in fresh if isinstance(t, Tensor) and t.requires_grad]
    with torch.enable_grad():
        out = fn(*(tree_unflatten(fresh, spec) for spec, fresh in trees))

    def pull(cotangent: Tensor) -> Tuple[Any, ...]:
        found = iter(torch.autograd.grad(out, leaves, cotangent, allow_unused=True, materialize_grads=True))
        return tuple(tree_unflatten([next(found) if isinstance(t, Tensor) and t.requires_grad else t for t in fresh],
                                    spec) for spec, fresh in trees)

    return out.detach(), pull
