"""`scan` rolled: the loop as one `scan` node of ember's traced step, differentiated by ember.

Inside `jit(backend="inductor")`'s trace (plain tensors, no `torch.func` transform active), `scan`
runs here, on torch's `scan` operator (`compat/scan.py`), whose body is a subgraph of the step and
which Inductor lowers to a loop writing each step's outputs into preallocated buffers. The forward
stacks, besides the `y`s, the carry each step started from when a gradient will be taken; the backward
is one more `scan` walking back: at each step the vjp of `f` at its saved carry (the step recomputed,
as `jax.checkpoint` of the body would), the carry's cotangent threaded through, each `x`'s stacked.
Both bodies compile once whatever the length.

The body is traced once each way (`compat/scan.py`), as `jax.lax.scan` traces it: its Python runs at
trace time. The tensors it closes over enter the loop as inputs: a dry run of one step finds them (the
tensors its torch calls read that are neither its arguments nor made by it), and the traced body reads
the loop's inputs in their place. A closed-over tensor that needs a gradient (parameters not passed
through `xs`) gets it as `rolled_scan`'s `consts` do: summed over the steps in the backward's carry. A
body whose gradient reaches such a tensor by a path its stand-in does not cover (found by one more dry
run) is not rolled: `scan` then runs its Python loop, with the same numbers.

DTensors (a stack of layers under `fsdp` or `tp`) enter the loop as their local shards (`local_shards`), and each
step rewraps them, so the body's DTensor ops trace into local ops and functional collectives inside the loop; a
slice of a stack is a local slice (`Layout.sliced`: not where the stack's first dim is split), the new carry is
redistributed to the old one's placements, and the stacked ys keep one step's. The dry runs record nothing into
the step's graph (a DTensor layer's collectives would stay there), and `compat.scan.drop_unread_inputs` takes out
of each loop what its body never reads (a stack's per-layer keys where no layer draws).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.overrides import TorchFunctionMode

from .autograd_grad import pull_back, run_differentiated
from .compat import gated_on
from .compat.dispatch_mode import TorchDispatchMode
from .compat.functorch import transform_wrapped
from .compat.scan import in_the_graph, torch_scan
from .local_shards import Layout, is_dtensor, like, local_as, local_tensor, rewrap, to_local
from .pytree import tree_flatten, tree_map, tree_unflatten
from .remat import _differentiable
from .remat_policies import Record, RematPolicy, Replay, flatten_saved, unflatten_saved
from .trace_context import here, loop_body, using_sharding
from .types import PyTree

__all__ = ["closes_over_gradients", "rolled_scan"]


def _fresh(t: Tensor) -> Tensor:
    return t.detach().requires_grad_(True) if _differentiable(t) else t


class _MadeBelow(TorchDispatchMode):
    """Adds to `made` what the ops under it return, those no function call returns included (what remat's
    `Record` keeps from inside a `linear`, which its backward reads back)."""

    supports_higher_order_operators = True  # a nested `scan`: recorded like any op

    def __init__(self, made: List[Tensor]) -> None:
        super().__init__()
        self.made = made

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.made.extend(t for t in tree_flatten(out)[0] if isinstance(t, Tensor))
        return out


class _Made(TorchFunctionMode):
    """Records every tensor the functions called under it read and return (and the ops below them return)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: List[Tensor] = []
        self.read: List[Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.read.extend(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor))
        out = func(*args, **(kwargs or {}))
        self.made.extend(t for t in tree_flatten(out)[0] if isinstance(t, Tensor))
        return out

    @contextlib.contextmanager
    def recording(self) -> Any:
        with self, _MadeBelow(self.made):
            yield self

    def closures(self, inputs: Sequence[Tensor]) -> List[Tensor]:
        """The tensors read that are neither `inputs` nor made here (nor wrapped by a transform the
        function ran, as `vmap` wraps its inputs), each once."""
        known, found = {id(t) for t in (*inputs, *self.made)}, {}
        known |= {id(local_tensor(t)) for t in inputs if is_dtensor(t)}
        for t in self.read:
            if id(t) in known or transform_wrapped(t):
                continue
            local = local_tensor(t) if is_dtensor(t) else t
            if id(local) in known or not in_the_graph(local):  # made here: by a DTensor method, in a dry run
                continue
            found.setdefault(id(t), t)
        return list(found.values())


class _Lifted(TorchFunctionMode):
    """Hands the functions called under it `stand_ins[id(t)]` wherever they are given a tensor `t` of it."""

    def __init__(self, stand_ins: Dict[int, Tensor]) -> None:
        super().__init__()
        self.stand_ins = stand_ins

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        swap = lambda v: self.stand_ins.get(id(v), v) if isinstance(v, Tensor) else v  # noqa: E731
        return func(*tree_map(swap, args), **tree_map(swap, kwargs or {}))


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


def _memory_order(t: Tensor) -> Tuple[int, ...]:
    """`t`'s dims, outermost in memory first: `t.permute` of it is contiguous when `t` is dense."""
    return tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))  # ties keep their order


def _inverse(order: Sequence[int]) -> Tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=lambda d: order[d]))


class _Tree:
    """A pytree's tensor leaves, and how to put them back among its other (None) leaves."""

    def __init__(self, tree: PyTree) -> None:
        self.leaves, self.spec = tree_flatten(tree)
        self.tensors: List[Tensor] = [v for v in self.leaves if isinstance(v, Tensor)]

    def rebuild(self, tensors: Sequence[Tensor]) -> PyTree:
        given = iter(tensors)
        return tree_unflatten([next(given) if isinstance(v, Tensor) else v for v in self.leaves], self.spec)


class _Shards:
    """Where the loop's inputs are DTensors: it runs on their local shards, and each step rewraps them with
    these layouts (None: a plain tensor); `x` are one slice's layouts, `y` one step's ys' (the dry run's)."""

    def __init__(self, carry: Sequence[Optional[Layout]], x: Sequence[Optional[Layout]],
                 k: Sequence[Optional[Layout]], y: Sequence[Optional[Layout]], out: Sequence[Optional[Layout]]) -> None:
        self.carry, self.x, self.k, self.y, self.out = tuple(carry), tuple(x), tuple(k), tuple(y), tuple(out)


class _Plan:
    """`f` over flat tensor lists, with the structure and slices a dry run of its first step found."""

    def __init__(self, f: Callable, carry: _Tree, xs: _Tree, consts: _Tree, closures: List[Tensor], length: int,
                 reverse: bool, y_meta: List[Tuple[torch.Size, torch.dtype]], policy: Optional[RematPolicy]) -> None:
        self.f, self.carry, self.xs, self.consts, self.closures = f, carry, xs, consts, closures
        self.n_carry, self.n_xs, self.n_consts = len(carry.tensors), len(xs.tensors), len(consts.tensors)
        self.length, self.reverse, self.y_meta = length, reverse, y_meta
        self.replays = policy is not None and policy.saves_anything  # the backward replays what the forward kept
        self.policy, self.kept_layout, self.kept_shards = policy, None, ()
        self.shards: Optional[_Shards] = None  # set where the loop's inputs are DTensors
        self.sharding = here().sharding  # the backward traces its body later, maybe outside the caller's sharding
        self.kept_orders: List[Tuple[int, ...]] = []  # each kept result's dims, outermost in memory first

    def step(self, carry: Sequence[Tensor], x: Sequence[Tensor], k: Sequence[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        """One step on flat lists: the new carry's leaves and the y leaves that are tensors. `k` holds the
        consts' tensors, then the loop's stand-ins for the tensors `f` closes over."""
        shards = self.shards
        if shards is not None:  # the loop's local shards, as the DTensors `f` computes on
            carry, x, k = rewrap(carry, shards.carry), rewrap(x, shards.x), rewrap(k, shards.k)
        stand_ins = dict(zip(map(id, self.closures), k[self.n_consts:]))
        with loop_body(), using_sharding(self.sharding), _Lifted(stand_ins) if stand_ins else contextlib.nullcontext():
            new, y = self.f(self.carry.rebuild(carry), self.xs.rebuild(x), self.consts.rebuild(k[:self.n_consts]))
        new = [v for v in tree_flatten(new)[0] if isinstance(v, Tensor)]
        y = [v for v in tree_flatten(y)[0] if isinstance(v, Tensor)]
        if shards is not None:
            new, y = local_as(new, shards.carry), local_as(y, shards.y)
        return new, y

    def recorded_step(self, carry: Sequence[Tensor], x: Sequence[Tensor],
                      k: Sequence[Tensor]) -> Tuple[List[Tensor], List[Tensor], List[Tensor]]:
        """`step`, and what the policy keeps of it, run differentiated in every floating input as the
        backward runs it: `Replay` matches results to ops by their order, so both must see the same ops."""
        flat = [*carry, *x, *k]
        floating = [i for i, t in enumerate(flat) if _differentiable(t)]

        def recorded(*diff: Tensor) -> Tuple[List[Tensor], List[Tensor], List[Tensor]]:
            c, xi, ki = self.split([*flat], floating, diff)
            with Record(self.policy, only_what_autograd_saves=True) as record:
                new, y = self.step(c, xi, ki)
            keys, structures, kept = flatten_saved(record.saved)
            kept, self.kept_shards = to_local(kept)  # what a DTensor op returned: its shard, then itself again
            self.kept_layout = (keys, structures)
            self.kept_orders = [_memory_order(t) for t in kept]
            return new, y, [t.permute(order) for t, order in zip(kept, self.kept_orders)]

        return run_differentiated(recorded, [flat[i] for i in floating])

    def split(self, flat: List[Tensor], positions: Sequence[int],
              values: Sequence[Tensor]) -> Tuple[List[Tensor], List[Tensor], List[Tensor]]:
        """`flat` (carry, x, then k) with `values` at `positions`, cut into the three."""
        for i, t in zip(positions, values):
            flat[i] = t
        n_c, n_x = self.n_carry, self.n_xs
        return flat[:n_c], flat[n_c:n_c + n_x], flat[n_c + n_x:]


class _Rolled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _Plan, *flat: Tensor) -> Tuple[Tensor, ...]:
        n_c, n_x = plan.n_carry, plan.n_xs
        carry, xs, consts = list(flat[:n_c]), list(flat[n_c:n_c + n_x]), list(flat[n_c + n_x:])
        save = any(ctx.needs_input_grad[1:])

        def step(c: List[Tensor], x: List[Tensor], k: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
            new, y, kept = plan.recorded_step(c, x, k) if save and plan.replays else (*plan.step(c, x, k), [])
            # a loop's outputs may not alias its inputs: fresh copies
            return [t.clone() for t in new], [t.clone() for t in (*y, *(c if save else ()), *kept)]

        final, stacked = torch_scan(step, carry, xs, consts, reverse=plan.reverse)
        n_y = len(plan.y_meta)
        ys, starts, kept = stacked[:n_y], stacked[n_y:n_y + n_c], stacked[n_y + n_c:]
        if save:
            ctx.plan, ctx.n_kept = plan, len(kept)
            ctx.save_for_backward(*xs, *consts, *starts, *kept)
        return (*final, *ys)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        plan: _Plan = ctx.plan
        saved = ctx.saved_tensors
        n_c, n_x = plan.n_carry, plan.n_xs
        saved, kept = saved[:len(saved) - ctx.n_kept], list(saved[len(saved) - ctx.n_kept:])
        xs, consts, starts = list(saved[:n_x]), list(saved[n_x:len(saved) - n_c]), list(saved[len(saved) - n_c:])
        # a cotangent may come as a DTensor: of an output that became one, or of a plain one (a 0-d total) that
        # DTensor ops read as replicated, whose cotangent is then the whole tensor
        grads = [g if g is None or not is_dtensor(g) else g.full_tensor() if layout is None
                 else local_as([g], [layout])[0]
                 for g, layout in zip(grads, plan.shards.out if plan.shards else [None] * len(grads))]
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
        # the inputs the vjp is taken in: replaying kept results needs the forward's, every floating one
        wrt_x = [k for k, x in enumerate(xs) if _differentiable(x)] if plan.replays else diff_x
        wrt_k = [k for k, c in enumerate(consts) if _differentiable(c)] if plan.replays else diff_k
        wrt = [*diff_c, *(n_c + k for k in wrt_x), *(n_c + n_x + k for k in wrt_k)]
        n_d, n_dx, n_gy = len(diff_c), len(diff_x), len(gys)

        def step(carried: List[Tensor], sliced: List[Tensor], consts: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
            gc, gk = carried[:n_d], carried[n_d:]  # the carry's cotangent, the consts' summed so far
            flat = [*sliced[:n_c + n_x], *consts]  # the step's carry, its x, the consts
            gy, kept_here = sliced[n_c + n_x:n_c + n_x + n_gy], sliced[n_c + n_x + n_gy:]

            def one(*diff: Tensor) -> List[Tensor]:
                as_kept = rewrap([t.permute(_inverse(order)) for t, order in zip(kept_here, plan.kept_orders)],
                                 plan.kept_shards)
                replay = (Replay(unflatten_saved(*plan.kept_layout, as_kept)) if kept_here
                          else contextlib.nullcontext())
                with replay:
                    new, y = plan.step(*plan.split(list(flat), wrt, diff))
                return [*(new[k] for k in diff_c), *(y[k] for k in diff_y)]

            pulled = pull_back(one, [flat[i] for i in wrt], [*gc, *gy])
            g_x, g_k = pulled[n_d:n_d + len(wrt_x)], pulled[n_d + len(wrt_x):]
            summed = [a + g_k[wrt_k.index(k)] for a, k in zip(gk, diff_k)]
            # fresh outputs: a cotangent the vjp passes through unchanged may not leave the loop as its input
            return [t.clone() for t in pulled[:n_d]] + summed, [g_x[wrt_x.index(k)].clone() for k in diff_x]

        # the forward's steps, last first: a forward scan's backward runs reversed, a reversed one's forward
        init = [*gc0, *(torch.zeros_like(consts[k]) for k in diff_k)]
        d_carried, d_xs = torch_scan(step, init, [*starts, *xs, *gys, *kept], consts, reverse=not plan.reverse)
        by_c, by_x = dict(zip(diff_c, d_carried[:n_d])), dict(zip(diff_x, d_xs[:n_dx]))
        by_k = dict(zip(diff_k, d_carried[n_d:]))
        return (None, *(by_c.get(k) for k in range(n_c)), *(by_x.get(k) for k in range(n_x)),
                *(by_k.get(k) for k in range(len(consts))))


@contextlib.contextmanager
def _dry_run() -> Any:
    """Gradients on, and nothing recorded into the step's graph: a dry run's collectives (a DTensor layer's
    all-gathers) would stay in it as side effects, an extra layer run every step."""
    with torch.enable_grad(), disable_proxy_modes_tracing():
        yield


def _lifts_every_read(run: Callable[[], Tuple[PyTree, PyTree]], inputs: Sequence[Tensor],
                      closures: Sequence[Tensor]) -> bool:
    """Whether a gradient reaches the closures only through their stand-ins: one more dry run of the step
    with fresh leaves standing in for them (a read `_Lifted` does not see would bake one into the body)."""
    stand_ins = [_fresh(t) for t in closures]
    with _dry_run(), _Made().recording() as made, _Lifted(dict(zip(map(id, closures), stand_ins))):
        out = run()
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad]
    return not closes_over_gradients(outputs, [*inputs, *stand_ins], made.made)


def rolled_scan(f: Callable[[PyTree, PyTree, PyTree], Tuple[PyTree, PyTree]], init: PyTree, xs: PyTree, length: int,
                reverse: bool, consts: PyTree = None,
                policy: Optional[RematPolicy] = None) -> Optional[Tuple[PyTree, PyTree]]:
    """`scan(lambda c, x: f(c, x, consts), init, xs)` as one `scan` node each way, or None where it cannot
    roll (module docstring). `consts` are what every step sees, gradients summed over the steps. With a
    `policy` that keeps something (`remat_policies`), the forward stacks what it keeps of each step and the
    backward hands it back instead of recomputing it (`scan(remat(f, policy))`). The caller checked `xs`
    (every leaf a tensor of leading dim `length`) and that ember's trace runs."""
    carry_tree, xs_tree, consts_tree = _Tree(init), _Tree(xs), _Tree(consts)
    carry, x_leaves, k_leaves = carry_tree.tensors, xs_tree.tensors, consts_tree.tensors
    if not carry or not x_leaves or any(v is not None and not isinstance(v, Tensor)
                                        for v in (*carry_tree.leaves, *xs_tree.leaves)):
        return None
    first_c, first_k = [_fresh(t) for t in carry], [_fresh(t) for t in k_leaves]
    first_x = [_fresh(t[length - 1 if reverse else 0]) for t in x_leaves]
    # a dry run of one step: the y structure, what it closes over
    with _dry_run(), _Made().recording() as made:
        new, y = f(carry_tree.rebuild(first_c), xs_tree.rebuild(first_x), consts_tree.rebuild(first_k))
    new_leaves, new_spec = tree_flatten(new)
    y_leaves, y_spec = tree_flatten(y)
    if new_spec != carry_tree.spec or any(
            (a is None) != (b is None) or isinstance(a, Tensor) and (
                a.shape != b.shape or a.dtype != b.dtype or is_dtensor(b) and not is_dtensor(a))
            for a, b in zip(new_leaves, carry_tree.leaves)):
        return None  # the Python loop names the mismatch
    if gated_on("dtensor_scan") and any(map(is_dtensor, (*carry, *x_leaves, *k_leaves, *new_leaves))):
        return None  # torch 2.9 and 2.10 (`compat.WORKAROUNDS`), decided before any DTensor is made below
    # a plain carry the step makes a DTensor (a mixture's router statistics summed over the batch's shards)
    # enters as the DTensor it becomes: the same on every process, placed as the step places it
    new_tensors = [v for v in new_leaves if isinstance(v, Tensor)]
    carry = [like(t, v) if is_dtensor(v) and not is_dtensor(t) else t for t, v in zip(carry, new_tensors)]
    if any(v is not None and not isinstance(v, Tensor) for v in (*new_leaves, *y_leaves)):
        return None
    y_tensors = [v for v in y_leaves if isinstance(v, Tensor)]
    closures = made.closures([*first_c, *first_x, *first_k])
    if torch.is_grad_enabled() and any(t.requires_grad for t in closures) and not _lifts_every_read(
            lambda: f(carry_tree.rebuild(first_c), xs_tree.rebuild(first_x), consts_tree.rebuild(first_k)),
            [*first_c, *first_x, *first_k], closures):
        return None
    # torch's op may run the body on its own inputs (its fake-tensor rule): a closure that is also one of
    # them enters that place as a copy, or the stand-in would take that place too
    lifted = {id(t) for t in closures}
    carry, x_leaves, k_leaves = ([t.clone() if id(t) in lifted else t for t in ts]
                                 for ts in (carry, x_leaves, k_leaves))
    flat, layouts = to_local([*carry, *x_leaves, *k_leaves, *closures])
    y_local, y_layouts = to_local(y_tensors)
    shards = None
    if any(layouts) or any(y_layouts):
        shards = _sharded(layouts, y_layouts, len(carry), len(x_leaves), length)
        if shards is None or gated_on("dtensor_scan"):  # torch 2.9 and 2.10: `compat.WORKAROUNDS`
            return None
    y_meta = [(v.shape, v.dtype) for v in y_local]
    plan = _Plan(f, carry_tree, xs_tree, consts_tree, closures, length, reverse, y_meta, policy)
    plan.shards = shards
    out = _Rolled.apply(plan, *flat)
    if shards is not None:  # the loop's shards as the DTensors they are
        out = rewrap(list(out), shards.out)
    final, stacked = list(out[:len(carry)]), iter(out[len(carry):])
    ys = [next(stacked) if isinstance(v, Tensor) else v for v in y_leaves]
    return carry_tree.rebuild(final), (None if y is None else tree_unflatten(ys, y_spec))


def _sharded(layouts: Sequence[Optional[Layout]], y_layouts: Sequence[Optional[Layout]], n_carry: int, n_x: int,
             length: int) -> Optional[_Shards]:
    """The layouts a step rewraps its shards with and those of the loop's outputs (the final carry, the
    stacked ys: `out`); None where a slice along dim 0 is not a local slice (`xs` split along it)."""
    x = [None if layout is None else layout.sliced() for layout in layouts[n_carry:n_carry + n_x]]
    stacked = [None if layout is None else layout.stacked(length) for layout in y_layouts]
    if any(a is not None and b is None for a, b in zip((*layouts[n_carry:n_carry + n_x], *y_layouts), (*x, *stacked))):
        return None
    carry = layouts[:n_carry]
    return _Shards(carry, x, layouts[n_carry + n_x:], y_layouts, [*carry, *stacked])
