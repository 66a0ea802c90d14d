"""Activation checkpointing (rematerialisation) on the autograd engine that ember's `grad` uses.

Public names: `remat` (also exported from `ember.core.transforms`).

`remat(block)` runs `block` without keeping its intermediate activations; the backward pass
recomputes them from the saved inputs. Peak activation memory of a stack of N remat'd blocks
drops from N blocks' intermediates to N block inputs plus one block's intermediates, for the
cost of one more forward per block.

How it works:

- The block runs inside a custom `torch.autograd.Function` that saves only the block's tensor
  inputs (and what a policy keeps) and, in backward, recomputes the block and pulls the incoming
  gradient back with `torch.autograd.grad` (`autograd_grad.pull_back`), the engine of ember's
  `grad`. Grad of grad stays exact: a backward run with `create_graph` records the recomputation.
  Not `torch.utils.checkpoint`: in the compiled step its selective policies only tag the traced
  nodes and its plain recomputation keeps most activations (BENCHMARKS.md, "One compile path").
- Compiled by `ember.core.jit` (the step traced with `make_fx`, gradient inside): the
  recomputation is part of the traced graph, tied to the incoming gradient by a barrier
  (`remat_barrier.py`) so that neither common-subexpression elimination nor the scheduler folds
  it back into the forward (BENCHMARKS.md, "How the step scales"). On torch_xla the barrier is
  torch_xla's optimization barrier.
- Policies (`policy=`, see `remat_policies.py`) keep chosen results (matmul outputs, tagged
  tensors) instead of recomputing them.
- `shared=True`: in the compiled step every call runs one compiled forward and one compiled
  backward (`shared_call`), so a stack of identical layers compiles like one.
- Inside a `torch.func` transform (`vmap`, `jvp`, `jacfwd`, a user's `torch.func.grad`) and under
  Dynamo (a user's `torch.compile`) the block runs plainly: the same values and gradients, nothing
  saved. Those transforms differentiate with their own engine, which does not run a recomputing
  backward without keeping what it recomputes (BENCHMARKS.md, "One gradient engine").

Inputs are pytrees (a params dict next to activations). Every floating-point tensor leaf gets a
gradient; integer tensors (RNG keys, token ids) and non-tensor leaves pass through. Arguments
listed in `static_argnums` are passed to the block untouched (flags, config objects, callables).
The block must be pure: randomness comes from an ember key argument, so the recomputation draws
the same numbers.

Example:
    >>> import torch
    >>> from ember.core.transforms import grad, remat
    >>> def block(p, x):
    ...     return torch.tanh(x @ p["w"])
    >>> def loss(p, x):
    ...     return remat(block)(p, x).sum()
    >>> p, x = {"w": torch.eye(2)}, torch.ones(1, 2)
    >>> torch.allclose(grad(loss)(p, x)["w"], grad(lambda p, x: block(p, x).sum())(p, x)["w"])
    True
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .autograd_grad import pull_back
from .pytree import tree_flatten, tree_unflatten
from .remat_barrier import tie_to_gradient
from .remat_policies import Record, RematPolicy, Replay, flatten_saved, remat_policy, unflatten_saved
from .shared_call import shared_call
from .trace_context import here
from .types import PyTree

__all__ = ["remat"]

def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _Plan:
    """How to turn the tensors handed to the autograd.Function back into the block's call.

    Built per call: holds the block, the static arguments and the non-tensor leaves; `run` records
    the output structure each time it executes the block.
    """

    def __init__(self, call: Callable[[Sequence[Tensor]], PyTree], policy: RematPolicy,
                 shared: Optional["_Shared"] = None, key: Any = None) -> None:
        self.call = call
        self.policy = policy
        self.shared = shared  # set when every call of this block is one compiled body
        self.key = key  # what, besides the tensors' shapes, the traced block depends on
        self.kept: List[Tensor] = []  # what the policy keeps, handed from forward to setup_context
        self.kept_layout: Any = ([], [])
        self.out_spec: Any = None
        self.out_leaves: List[Any] = []
        self.out_tensor_idx: List[int] = []
        self.diff_out: List[int] = []

    def run(self, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        out = self.call(tensors)
        leaves, self.out_spec = tree_flatten(out)
        self.out_tensor_idx = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
        self.out_leaves = [None if isinstance(v, Tensor) else v for v in leaves]
        outs = tuple(leaves[i] for i in self.out_tensor_idx)
        self.diff_out = [j for j, t in enumerate(outs) if _differentiable(t)]
        return outs

    def rebuild(self, outs: Sequence[Tensor]) -> PyTree:
        leaves = list(self.out_leaves)
        for i, t in zip(self.out_tensor_idx, outs):
            leaves[i] = t
        return tree_unflatten(leaves, self.out_spec)


def _run_and_record(plan: _Plan, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """Run the block; keep what the policy selects in `plan.kept` (laid out in `plan.kept_layout`)."""
    if not plan.policy.saves_anything:
        return plan.run(tensors)
    with Record(plan.policy) as record:
        outs = plan.run(tensors)
    keys, structures, plan.kept = flatten_saved(record.saved)
    plan.kept_layout = (keys, structures)
    return outs


# What the traced call of a shared block learns about its outputs; the calls it serves copy it.
_LAYOUT = ("out_spec", "out_leaves", "out_tensor_idx", "diff_out", "kept_layout")


class _Shared:
    """The forward and backward of a block whose calls share one compiled body (`shared_call`).

    `plan` is the calling plan: the body is traced from the first call with a given key only, and
    every call with that key runs the same graph.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.plan: Optional[_Plan] = None
        self.forward = self._forward  # bound once: shared_call tells functions apart by identity
        self.backward = self._backward

    def _forward(self, tensors: List[Tensor], key: Any) -> Tuple[List[Tensor], List[Tensor], Any]:
        plan = self.plan
        outs = _run_and_record(plan, tensors)
        passed = {id(t) for t in (*tensors, *plan.kept)}
        layout = types.SimpleNamespace(**{name: getattr(plan, name) for name in _LAYOUT})  # one leaf
        # the body may not hand back its own input, nor one tensor twice
        return [t.clone() if id(t) in passed else t for t in outs], list(plan.kept), layout

    def _backward(self, saved: List[Tensor], grad_outputs: List[Optional[Tensor]], needs: Tuple[bool, ...],
                  key: Any) -> List[Optional[Tensor]]:
        return _recompute_here(self.plan, saved, grad_outputs, needs)


class _RematFunction(torch.autograd.Function):
    """Saves only the block's inputs; backward recomputes the block and pulls the gradient back."""

    @staticmethod
    def forward(plan: _Plan, *tensors: Tensor) -> Tuple[Tensor, ...]:
        if plan.shared is not None and here().shares:
            plan.shared.plan = plan
            outs, plan.kept, layout = shared_call(plan.shared.forward, plan.shared.name, list(tensors), plan.key)
            for name in _LAYOUT:
                setattr(plan, name, getattr(layout, name))
            return tuple(outs)
        outs = _run_and_record(plan, tensors)
        # An input (or a kept result) returned as-is cannot also be saved under setup_context: return a view.
        saved = {id(t) for t in (*tensors, *plan.kept)}
        return tuple(t.view_as(t) if id(t) in saved else t for t in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, ...]) -> None:
        plan, *tensors = inputs
        ctx.plan = plan
        ctx.save_for_backward(*tensors, *plan.kept)
        nondiff = [t for t in output if not _differentiable(t)]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        return (None, *_recompute(ctx.plan, ctx.saved_tensors, grad_outputs, ctx.needs_input_grad[1:]))


def _recompute(
    plan: _Plan,
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Optional[Tensor]],
    needs: Sequence[bool],
) -> List[Optional[Tensor]]:
    """Re-run the block on `saved` and pull `grad_outputs` back to its inputs.

    `saved` is the block's inputs followed by what the policy kept, which the recomputation takes
    back instead of running those ops again.
    """
    if plan.shared is not None and here().shares:
        plan.shared.plan = plan
        return shared_call(plan.shared.backward, plan.shared.name + ".backward", list(saved),
                           list(grad_outputs), tuple(bool(n) for n in needs), plan.key)
    return _recompute_here(plan, saved, grad_outputs, needs)


def _recompute_here(
    plan: _Plan,
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Optional[Tensor]],
    needs: Sequence[bool],
) -> List[Optional[Tensor]]:
    saved, kept = tie_to_gradient(saved[: len(needs)], grad_outputs), saved[len(needs):]
    replay = Replay(unflatten_saved(*plan.kept_layout, kept)) if kept else contextlib.nullcontext()
    diff_in = [i for i, t in enumerate(saved) if needs[i] and _differentiable(t)]

    def recompute(*diff_tensors: Tensor) -> List[Tensor]:
        tensors = list(saved)
        for i, t in zip(diff_in, diff_tensors):
            tensors[i] = t
        with replay:
            outs = plan.run(tensors)
        return [outs[j] for j in plan.diff_out]

    pulled = pull_back(recompute, [saved[i] for i in diff_in], [grad_outputs[j] for j in plan.diff_out])
    grads: List[Optional[Tensor]] = [None] * len(saved)
    for i, g in zip(diff_in, pulled):
        grads[i] = g
    return grads


def _normalise_static_argnums(static_argnums: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    if isinstance(static_argnums, int) and not isinstance(static_argnums, bool):
        static_argnums = (static_argnums,)
    if not isinstance(static_argnums, (tuple, list)) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in static_argnums
    ):
        raise TypeError(
            f"static_argnums must be an int or a tuple of ints, got {static_argnums!r}; "
            "e.g. static_argnums=(2,) to pass the third positional argument through untouched."
        )
    return tuple(static_argnums)


def remat(
    fn: Callable,
    *,
    policy: Union[str, RematPolicy, bool] = "full",
    static_argnums: Union[int, Sequence[int]] = (),
    shared: bool = False,
) -> Callable:
    """Wrap `fn` so its activations are recomputed in the backward pass instead of stored.

    Saves memory eagerly with ordinary autograd, nested in `grad` / `value_and_grad` (any depth),
    inside `scan`, in `jit`'s step and on torch_xla; inside `vmap` / `torch.func` transforms and
    under `torch.compile` it is a plain call (see the module docstring).

    Args:
        fn: a pure function of pytrees of tensors; it may return any pytree.
        policy: what to keep besides the inputs (`ember.core.remat_policies`): `"full"` (nothing),
            `"dots_saveable"` (matmul outputs), `"dots_with_no_batch_dims_saveable"`,
            `"save:<tag>,..."` / `save_names(...)` (tensors tagged with `checkpoint_name`), or
            `"none"` (return `fn` itself: no remat).
        static_argnums: positional arguments passed through as they are, never flattened
            (Python flags, config objects, callables; negative indices count from the end).
        shared: in `jit(backend="inductor")`, every call of the returned function with the same
            shapes runs one compiled forward and one compiled backward (`ember.core.shared_call`):
            a stack of identical layers compiles like one layer. With `policy="none"` the calls
            keep every result but reshapes and 0-d ones (`"everything_saveable"`).

    Returns:
        A function with `fn`'s signature and outputs whose backward pass re-runs `fn`.

    Raises:
        TypeError: `static_argnums` is not an int or a tuple of ints.
        ValueError: an unknown policy name (the nearest names are listed).
        ValueError: at call time, a `static_argnums` index has no matching positional argument.

    Example:
        >>> import torch
        >>> from ember.core.transforms import remat, value_and_grad
        >>> def mlp(p, x, act):
        ...     return act(x @ p["w1"]) @ p["w2"]
        >>> block = remat(mlp, static_argnums=(2,))
        >>> p = {"w1": torch.ones(3, 4), "w2": torch.ones(4, 3)}
        >>> loss = lambda p, x: block(p, x, torch.relu).sum()
        >>> value, g = value_and_grad(loss)(p, torch.ones(2, 3))
        >>> float(value), g["w2"].shape
        (72.0, torch.Size([4, 3]))
    """
    static = _normalise_static_argnums(static_argnums)
    chosen = remat_policy(policy)
    plain = chosen is None
    if plain and not shared:
        return fn
    if plain:
        chosen = remat_policy("everything_saveable")
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    share = _Shared(f"ember.remat.{name}") if shared else None

    @functools.wraps(fn)
    def rematted(*args: Any, **kwargs: Any) -> Any:
        h = here()
        if h.torch_func or (plain and not h.shares):
            return fn(*args, **kwargs)  # their engine would keep what remat recomputes / nothing to remat
        n = len(args)
        static_pos = set()
        for i in static:
            if not -n <= i < n:
                raise ValueError(
                    f"remat({name}, static_argnums={static}): index {i} has no matching "
                    f"positional argument; the call passed {n}. Pass static arguments "
                    "positionally, or fix static_argnums."
                )
            static_pos.add(i % n)
        static_args = {i: args[i] for i in static_pos}  # keep no reference to tensor args
        dynamic = [a for i, a in enumerate(args) if i not in static_pos]
        leaves, spec = tree_flatten((dynamic, kwargs))
        tensor_idx = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
        consts = [None if isinstance(v, Tensor) else v for v in leaves]

        def call(tensors: Sequence[Tensor]) -> PyTree:
            full = list(consts)
            for i, t in zip(tensor_idx, tensors):
                full[i] = t
            dyn, kw = tree_unflatten(full, spec)
            it = iter(dyn)
            call_args = [static_args[i] if i in static_args else next(it) for i in range(n)]
            return fn(*call_args, **kw)

        tensors = [leaves[i] for i in tensor_idx]
        key = None
        if share is not None and not static_pos:  # static arguments are objects: they cannot key a body
            key = (repr(spec), tuple(consts))
        plan = _Plan(call, chosen, share if key is not None else None, key)
        outs = _RematFunction.apply(plan, *tensors)
        return plan.rebuild(outs)

    return rematted
