"""`scan` rolled: the loop as one `scan` node of ember's traced step, differentiated by ember.

Inside `jit(backend="inductor")`'s trace (plain tensors, no `torch.func` transform active), `scan`
runs here, on torch's `scan` operator (`compat/scan.py`), whose body is a subgraph of the step and
which Inductor lowers to a loop writing each step's outputs into preallocated buffers. The forward
stacks, besides the `y`s, the carry each step started from when a gradient will be taken; the backward
is one more `scan` walking back: at each step the vjp of `f` at its saved carry (the step recomputed,
as `jax.checkpoint` of the body would), the carry's cotangent threaded through, each `x`'s stacked.
Both bodies compile once whatever the length.

A body that closes over a tensor needing a gradient (parameters not passed through `xs`) is not rolled:
its gradient would have to leave the loop by a path the loop does not have; `rolled_scan`'s `consts`
are such tensors made explicit (their gradients summed over the steps in the backward's carry).
A body that is not pure in Python (it appends to a list, prints: torch's `scan` traces it with Dynamo)
is not rolled either, with a warning. `scan` then runs its Python loop, with the same numbers.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from .compat import warn_once
from .compat.scan import BodyNotTraceable, torch_scan
from .pytree import tree_flatten, tree_unflatten
from .remat import _differentiable
from .types import PyTree

__all__ = ["closes_over_gradients", "rolled_scan"]


def _distinct(tensors: Sequence[Tensor]) -> List[Tensor]:
    """`tensors`, a copy where one tensor stands for a second leaf: a loop's inputs may not alias."""
    seen: set = set()
    out = []
    for t in tensors:
        out.append(t.clone() if id(t) in seen else t)
        seen.add(id(t))
    return out


def _fresh(t: Tensor) -> Tensor:
    return t.detach().requires_grad_(True) if _differentiable(t) else t


class _Made(TorchFunctionMode):
    """Records every tensor the functions called under it return."""

    def __init__(self) -> None:
        super().__init__()
        self.made: List[Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.made.extend(t for t in tree_flatten(out)[0] if isinstance(t, Tensor))
        return out


def closes_over_gradients(outputs: Sequence[Tensor], inputs: Sequence[Tensor], made: Sequence[Tensor] = ()) -> bool:
    """Whether the autograd graph of `outputs` reaches a leaf other than `inputs` and the tensors the
    function `made` itself (an inner gradient's fresh leaves): a tensor it closed over that needs a gradient."""
    own = {id(t) for t in (*inputs, *made)}
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


class _Tree:
    """A pytree's tensor leaves, and how to put them back among its other (None) leaves."""

    def __init__(self, tree: PyTree) -> None:
        self.leaves, self.spec = tree_flatten(tree)
        self.tensors: List[Tensor] = [v for v in self.leaves if isinstance(v, Tensor)]

    def rebuild(self, tensors: Sequence[Tensor]) -> PyTree:
        given = iter(tensors)
        return tree_unflatten([next(given) if isinstance(v, Tensor) else v for v in self.leaves], self.spec)


class _Plan:
    """`f` over flat tensor lists, with the structure and slices a dry run of its first step found."""

    def __init__(self, f: Callable, carry: _Tree, xs: _Tree, consts: _Tree, length: int, reverse: bool,
                 y_meta: List[Tuple[torch.Size, torch.dtype]]) -> None:
        self.f, self.carry, self.xs, self.consts = f, carry, xs, consts
        self.n_carry, self.n_xs = len(carry.tensors), len(xs.tensors)
        self.length, self.reverse, self.y_meta = length, reverse, y_meta

    def step(self, carry: Sequence[Tensor], x: Sequence[Tensor], k: Sequence[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        """One step on flat lists: the new carry's leaves and the y leaves that are tensors."""
        new, y = self.f(self.carry.rebuild(carry), self.xs.rebuild(x), self.consts.rebuild(k))
        return [v for v in tree_flatten(new)[0] if isinstance(v, Tensor)], [
            v for v in tree_flatten(y)[0] if isinstance(v, Tensor)]


class _Rolled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _Plan, *flat: Tensor) -> Tuple[Tensor, ...]:
        n_c, n_x = plan.n_carry, plan.n_xs
        carry, xs, consts = list(flat[:n_c]), list(flat[n_c:n_c + n_x]), list(flat[n_c + n_x:])
        save = any(ctx.needs_input_grad[1:])

        def step(c: List[Tensor], x: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
            new, y = plan.step(c, x, consts)  # a loop's outputs may not alias its inputs: fresh copies
            return [t.clone() for t in new], [t.clone() for t in (*y, *(c if save else ()))]

        final, stacked = torch_scan(step, _distinct(carry), xs, reverse=plan.reverse)
        ys, starts = stacked[:len(plan.y_meta)], stacked[len(plan.y_meta):]
        if save:
            ctx.plan = plan
            ctx.save_for_backward(*xs, *consts, *starts)
        return (*final, *ys)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        plan: _Plan = ctx.plan
        saved = ctx.saved_tensors
        n_c, n_x = plan.n_carry, plan.n_xs
        xs, consts, starts = list(saved[:n_x]), list(saved[n_x:len(saved) - n_c]), list(saved[len(saved) - n_c:])
        g_carry, g_ys = grads[:n_c], grads[n_c:]
        diff_c = [k for k, c in enumerate(starts) if _differentiable(c)]
        diff_x = [k for k, x in enumerate(xs) if _differentiable(x) and ctx.needs_input_grad[1 + n_c + k]]
        diff_k = [k for k, c in enumerate(consts) if _differentiable(c) and ctx.needs_input_grad[1 + n_c + n_x + k]]
        diff_y = [k for k, (_, dtype) in enumerate(plan.y_meta) if dtype.is_floating_point or dtype.is_complex]
        # copies: cotangents may be views of one tensor (the expanded ones of a sum), a loop's carries may not
        gc0 = [(g_carry[k] if g_carry[k] is not None else torch.zeros_like(starts[k][0])).clone(
            memory_format=torch.contiguous_format) for k in diff_c]
        gys = [g_ys[k] if g_ys[k] is not None else torch.zeros((plan.length, *plan.y_meta[k][0]),
                                                                dtype=plan.y_meta[k][1], device=starts[0].device)
               for k in diff_y]
        n_d, n_dx = len(diff_c), len(diff_x)

        def step(carried: List[Tensor], sliced: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
            gc, gk = carried[:n_d], carried[n_d:]  # the carry's cotangent, the consts' summed so far
            c, x, gy = sliced[:n_c], sliced[n_c:n_c + n_x], sliced[n_c + n_x:]

            def one(*diff: Tensor) -> Tuple[Tensor, ...]:
                c_full, x_full, k_full = list(c), list(x), list(consts)
                for positions, full, values in ((diff_c, c_full, diff[:n_d]), (diff_x, x_full, diff[n_d:n_d + n_dx]),
                                                (diff_k, k_full, diff[n_d + n_dx:])):
                    for k, t in zip(positions, values):
                        full[k] = t
                new, y = plan.step(c_full, x_full, k_full)
                return (*(new[k] for k in diff_c), *(y[k] for k in diff_y))

            _, pull = torch.func.vjp(one, *[c[k] for k in diff_c], *[x[k] for k in diff_x],
                                     *[consts[k] for k in diff_k])
            pulled = pull((*gc, *gy))
            summed = [a + b for a, b in zip(gk, pulled[n_d + n_dx:])]
            # torch 2.9's Inductor fails on a backward loop without ys ("getitem is not an OpOverload"): one 0-d y
            # fresh outputs: a cotangent the vjp passes through unchanged may not leave the loop as its input
            return ([t.clone() for t in pulled[:n_d]] + summed,
                    [t.clone() for t in pulled[n_d:n_d + n_dx]] or [c[0].new_zeros(())])

        # the forward's steps, last first: a forward scan's backward runs reversed, a reversed one's forward
        init = _distinct([*gc0, *(torch.zeros_like(consts[k]) for k in diff_k)])
        d_carried, d_xs = torch_scan(step, init, [*starts, *xs, *gys], reverse=not plan.reverse)
        by_c, by_x = dict(zip(diff_c, d_carried[:n_d])), dict(zip(diff_x, d_xs[:n_dx]))
        by_k = dict(zip(diff_k, d_carried[n_d:]))
        return (None, *(by_c.get(k) for k in range(n_c)), *(by_x.get(k) for k in range(n_x)),
                *(by_k.get(k) for k in range(len(consts))))


def rolled_scan(f: Callable[[PyTree, PyTree, PyTree], Tuple[PyTree, PyTree]], init: PyTree, xs: PyTree, length: int,
                reverse: bool, consts: PyTree = None) -> Optional[Tuple[PyTree, PyTree]]:
    """`scan(lambda c, x: f(c, x, consts), init, xs)` as one `scan` node each way, or None where it cannot
    roll (module docstring). `consts` are what every step sees, gradients summed over the steps. The
    caller checked `xs` (every leaf a tensor of leading dim `length`) and that ember's trace runs."""
    carry_tree, xs_tree, consts_tree = _Tree(init), _Tree(xs), _Tree(consts)
    carry, x_leaves, k_leaves = carry_tree.tensors, xs_tree.tensors, consts_tree.tensors
    if not carry or not x_leaves or any(v is not None and not isinstance(v, Tensor)
                                        for v in (*carry_tree.leaves, *xs_tree.leaves)):
        return None
    first_c, first_k = [_fresh(t) for t in carry], [_fresh(t) for t in k_leaves]
    first_x = [_fresh(t[length - 1 if reverse else 0]) for t in x_leaves]
    with torch.enable_grad(), _Made() as made:  # a dry run of one step: the y structure, what it closes over
        new, y = f(carry_tree.rebuild(first_c), xs_tree.rebuild(first_x), consts_tree.rebuild(first_k))
    new_leaves, new_spec = tree_flatten(new)
    y_leaves, y_spec = tree_flatten(y)
    if new_spec != carry_tree.spec or any(
            (a is None) != (b is None) or isinstance(a, Tensor) and (a.shape != b.shape or a.dtype != b.dtype)
            for a, b in zip(new_leaves, carry_tree.leaves)):
        return None  # the Python loop names the mismatch
    if any(v is not None and not isinstance(v, Tensor) for v in (*new_leaves, *y_leaves)):
        return None
    outputs = [t for t in (*new_leaves, *y_leaves) if isinstance(t, Tensor) and t.requires_grad]
    if torch.is_grad_enabled() and closes_over_gradients(outputs, [*first_c, *first_x, *first_k], made.made):
        return None
    y_meta = [(v.shape, v.dtype) for v in y_leaves if isinstance(v, Tensor)]
    plan = _Plan(f, carry_tree, xs_tree, consts_tree, length, reverse, y_meta)
    try:
        out = _Rolled.apply(plan, *carry, *x_leaves, *k_leaves)
    except BodyNotTraceable as err:
        warn_once(f"scan_unrolled:{err}", (
            f"scan: the loop's body cannot roll, it runs unrolled (compile time grows with the length): {err} "
            "Keep the body pure (no Python side effects: appends, prints, globals) to roll it."))
        return None
    final, stacked = list(out[:len(carry)]), iter(out[len(carry):])
    ys = [next(stacked) if isinstance(v, Tensor) else v for v in y_leaves]
    return carry_tree.rebuild(final), (None if y is None else tree_unflatten(ys, y_spec))
