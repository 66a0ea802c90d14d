"""`scan` rolled: the loop as one `scan` node of ember's traced step, differentiated by ember.

Inside `jit(backend="inductor")`'s trace (plain tensors, no `torch.func` transform active), `scan`
runs here, on torch's `scan` operator (`compat/scan.py`), whose body is a subgraph of the step and
which Inductor lowers to a loop writing each step's outputs into preallocated buffers. The forward
stacks, besides the `y`s, the carry each step started from when a gradient will be taken; the backward
is one more `scan` walking back: at each step the vjp of `f` at its saved carry (the step recomputed,
as `jax.checkpoint` of the body would), the carry's cotangent threaded through, each `x`'s stacked.
Both bodies compile once whatever the length.

A body that closes over a tensor needing a gradient (parameters not passed through `xs`) is not rolled:
its gradient would have to leave the loop by a path the loop does not have. `scan` then runs its
Python loop, with the same numbers.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .compat.scan import torch_scan
from .pytree import tree_flatten, tree_unflatten
from .remat import _differentiable
from .types import PyTree

__all__ = ["closes_over_gradients", "rolled_scan"]


def _fresh(t: Tensor) -> Tensor:
    return t.detach().requires_grad_(True) if _differentiable(t) else t


def closes_over_gradients(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> bool:
    """Whether the autograd graph of `outputs` reaches a leaf other than `inputs`: a tensor the
    function closed over that needs a gradient."""
    own = {id(t) for t in inputs}
    seen, todo = set(), [t.grad_fn for t in outputs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None and id(variable) not in own:
            return True
        todo.extend(next_node for next_node, _ in node.next_functions)
    return False


class _Plan:
    """`f` over flat tensor lists, with the structure and slices a dry run of its first step found."""

    def __init__(self, f: Callable, carry_spec: Any, xs_spec: Any, n_carry: int, length: int, reverse: bool,
                 y_meta: List[Tuple[torch.Size, torch.dtype]]) -> None:
        self.f, self.carry_spec, self.xs_spec, self.n_carry = f, carry_spec, xs_spec, n_carry
        self.length, self.reverse, self.y_meta = length, reverse, y_meta

    def step(self, carry: Sequence[Tensor], x: Sequence[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        """One step on flat lists: the new carry's leaves and the y leaves that are tensors."""
        new, y = self.f(tree_unflatten(list(carry), self.carry_spec), tree_unflatten(list(x), self.xs_spec))
        return tree_flatten(new)[0], [v for v in tree_flatten(y)[0] if isinstance(v, Tensor)]


class _Rolled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _Plan, *flat: Tensor) -> Tuple[Tensor, ...]:
        carry, xs = list(flat[:plan.n_carry]), list(flat[plan.n_carry:])
        save = any(ctx.needs_input_grad[1:])

        def step(c: List[Tensor], x: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
            new, y = plan.step(c, x)  # a loop's outputs may not alias its inputs: fresh carries
            return [t.clone() for t in new], [*y, *([t.clone() for t in c] if save else [])]

        final, stacked = torch_scan(step, carry, xs, reverse=plan.reverse)
        ys, starts = stacked[:len(plan.y_meta)], stacked[len(plan.y_meta):]
        if save:
            ctx.plan = plan
            ctx.save_for_backward(*xs, *starts)
        return (*final, *ys)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        plan: _Plan = ctx.plan
        saved = ctx.saved_tensors
        n_c = plan.n_carry
        xs, starts = list(saved[:len(saved) - n_c]), list(saved[len(saved) - n_c:])
        g_carry, g_ys = grads[:n_c], grads[n_c:]
        diff_c = [k for k, c in enumerate(starts) if _differentiable(c)]
        diff_x = [k for k, x in enumerate(xs) if _differentiable(x)]
        diff_y = [k for k, (_, dtype) in enumerate(plan.y_meta) if dtype.is_floating_point or dtype.is_complex]
        gc0 = [(g_carry[k] if g_carry[k] is not None else torch.zeros_like(starts[k][0])).contiguous()
               for k in diff_c]
        gys = [g_ys[k] if g_ys[k] is not None else torch.zeros((plan.length, *plan.y_meta[k][0]),
                                                                dtype=plan.y_meta[k][1], device=starts[0].device)
               for k in diff_y]
        n_d = len(diff_c)

        def step(gc: List[Tensor], sliced: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
            c, x, gy = sliced[:n_c], sliced[n_c:n_c + len(xs)], sliced[n_c + len(xs):]

            def one(*diff: Tensor) -> Tuple[Tensor, ...]:
                c_full, x_full = list(c), list(x)
                for k, t in zip(diff_c, diff[:n_d]):
                    c_full[k] = t
                for k, t in zip(diff_x, diff[n_d:]):
                    x_full[k] = t
                new, y = plan.step(c_full, x_full)
                return (*(new[k] for k in diff_c), *(y[k] for k in diff_y))

            _, pull = torch.func.vjp(one, *[c[k] for k in diff_c], *[x[k] for k in diff_x])
            pulled = pull((*gc, *gy))
            return [t.clone() for t in pulled[:n_d]], list(pulled[n_d:])

        # the forward's steps, last first: a forward scan's backward runs reversed, a reversed one's forward
        d_init, d_xs = torch_scan(step, gc0, [*starts, *xs, *gys], reverse=not plan.reverse)
        by_c, by_x = dict(zip(diff_c, d_init)), dict(zip(diff_x, d_xs))
        return (None, *(by_c.get(k) for k in range(n_c)), *(by_x.get(k) for k in range(len(xs))))


def rolled_scan(f: Callable[[PyTree, PyTree], Tuple[PyTree, PyTree]], init: PyTree, xs: PyTree, length: int,
                reverse: bool) -> Optional[Tuple[PyTree, PyTree]]:
    """`scan(f, init, xs)` as one `scan` node each way, or None where it cannot roll (module docstring).
    The caller checked `xs` (every leaf a tensor of leading dim `length`) and that ember's trace runs."""
    carry, carry_spec = tree_flatten(init)
    x_leaves, xs_spec = tree_flatten(xs)
    if not carry or not x_leaves or not all(isinstance(t, Tensor) for t in (*carry, *x_leaves)):
        return None
    first_c = [_fresh(t) for t in carry]
    first_x = [_fresh(t[length - 1 if reverse else 0]) for t in x_leaves]
    with torch.enable_grad():  # a dry run of one step: the y structure, and what it closes over
        new, y = f(tree_unflatten(first_c, carry_spec), tree_unflatten(first_x, xs_spec))
    new_leaves, new_spec = tree_flatten(new)
    y_leaves, y_spec = tree_flatten(y)
    if new_spec != carry_spec or any(not isinstance(a, Tensor) or a.shape != b.shape or a.dtype != b.dtype
                                     for a, b in zip(new_leaves, carry)):
        return None  # the Python loop names the mismatch
    if any(v is not None and not isinstance(v, Tensor) for v in y_leaves):
        return None
    outputs = [t for t in (*new_leaves, *y_leaves) if isinstance(t, Tensor) and t.requires_grad]
    if torch.is_grad_enabled() and closes_over_gradients(outputs, [*first_c, *first_x]):
        return None
    y_meta = [(v.shape, v.dtype) for v in y_leaves if isinstance(v, Tensor)]
    plan = _Plan(f, carry_spec, xs_spec, len(carry), length, reverse, y_meta)
    out = _Rolled.apply(plan, *carry, *x_leaves)
    final, stacked = list(out[:len(carry)]), iter(out[len(carry):])
    ys = [next(stacked) if isinstance(v, Tensor) else v for v in y_leaves]
    return tree_unflatten(final, carry_spec), (None if y is None else tree_unflatten(ys, y_spec))
