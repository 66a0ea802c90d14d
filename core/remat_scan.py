"""`remat_scan`: layers applied one after the other, each rematerialised, as one loop each way.

Public name: `remat_scan` (also exported from `ember.core.transforms`).

`remat_scan(fn, carry, xs, consts, policy=...)` computes what `scan` of `remat(fn, policy=...)`
computes: the forward keeps each layer's input and what the policy names (stacked over layers),
and the backward recomputes one layer at a time, handing the kept results back instead of
recomputing them (`remat_policies.Replay`). Policy `"none"` keeps every result and recomputes
nothing (`everything_saveable`). In ember's Inductor step the forward loop and the backward loop
are each one `ember::rolled_loop` node (`rolled_loop.py`): a layer's forward and its vjp are
compiled once, apart from the step, so the step's compile time does not grow with depth. On
torch_xla, with a policy that keeps nothing (`"full"`), they are XLA `While`s. Elsewhere (eagerly,
under Dynamo or `vmap`, with DTensor inputs) it is `scan` of `remat(fn, shared=True)`: the same
numbers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .autograd_grad import pull_back, run_differentiated
from .compat.functorch import any_transform_active
from .compat.shared_subgraph import run_untraced, sharing
from .compat.xla_loop import inside_xla_fold, xla_scan
from .jit_backends.dtensor_local import has_dtensor
from .remat import _differentiable, remat
from .remat_policies import Record, RematPolicy, Replay, flatten_saved, remat_policy, unflatten_saved
from .rolled_loop import Compiled, Flat, meta, new_stacked, rolling, run_loop
from .scan import scan
from .types import PyTree

__all__ = ["remat_scan"]


def _floating(tensors: Sequence[Tensor]) -> List[int]:
    return [i for i, t in enumerate(tensors) if _differentiable(t)]


class _Plan:
    """The layer as a function of flat tensor lists, and its forward and backward loops.

    Saved for the backward, stacked over layers: each layer's input, then what the policy kept
    (laid out as `kept_layout`).
    """

    def __init__(self, fn: Callable, xs: Flat, consts: Flat, length: int, policy: RematPolicy, name: str,
                 on_xla: bool) -> None:
        self.fn, self.xs, self.consts, self.length, self.name = fn, xs, consts, length, name
        self.policy, self.on_xla = policy, on_xla  # on_xla: the loops are XLA Whiles
        self.kept_layout: Any = ([], [])
        self.compiled_layer = Compiled(self.recorded_layer)

    def layer(self, carry: Tensor, x: List[Tensor], c: List[Tensor]) -> Tensor:
        return self.fn(carry, self.xs.rebuild(x), self.consts.rebuild(c))

    def layer_wrt(self, x: List[Tensor], c: List[Tensor], wrt_x: List[int], wrt_c: List[int]) -> Callable:
        """The layer as a function of the carry and the `wrt_x` / `wrt_c` tensors of `x` and `c`."""

        def pulled(carry: Tensor, dx: List[Tensor], dc: List[Tensor]) -> Tensor:
            x_full, c_full = list(x), list(c)
            for i, t in zip(wrt_x, dx):
                x_full[i] = t
            for i, t in zip(wrt_c, dc):
                c_full[i] = t
            return self.layer(carry, x_full, c_full)

        return pulled

    def recorded_layer(self, carry: Tensor, x: List[Tensor], c: List[Tensor]) -> Tuple[Tensor, List[Tensor]]:
        """The layer's output and what the policy keeps of this call.

        Run differentiated, as the backward replays it: an op's decomposition may depend on whether
        its inputs are differentiated (SDPA, matmul), and `Replay` matches results to ops by their
        order, so both must see the same ops (measured: a [.., 192] result handed to an op
        expecting [.., 512] when the forward ran plainly).
        """
        if not self.policy.saves_anything:
            return self.layer(carry, x, c), []
        wrt_x, wrt_c = _floating(x), _floating(c)
        layer = self.layer_wrt(x, c, wrt_x, wrt_c)

        def recorded(carry: Tensor, *diff: Tensor) -> Tuple[Tensor, List[Tensor]]:
            with Record(self.policy) as record:
                out = layer(carry, list(diff[:len(wrt_x)]), list(diff[len(wrt_x):]))
            keys, structures, kept = flatten_saved(record.saved)
            self.kept_layout = (keys, structures)
            passed = {id(carry), *map(id, diff)}  # a compiled body may not return its input
            return out, [t.clone() if id(t) in passed else t for t in kept]

        return run_differentiated(recorded, [carry, *(x[i] for i in wrt_x), *(c[i] for i in wrt_c)])

    def split(self, tensors: Sequence[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        n = len(self.xs.tensors)
        return list(tensors[:n]), list(tensors[n:])

    def check(self, new: Tensor, carry: Tensor) -> None:
        if new.shape != carry.shape or new.dtype != carry.dtype:
            raise ValueError(
                f"{self.name}: the layer returned {tuple(new.shape)} {new.dtype} for a carry of "
                f"{tuple(carry.shape)} {carry.dtype}; a scanned layer must return a carry shaped like "
                "its input (project in a layer outside the stack).")

    def forward(self, carry: Tensor, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The last carry, every layer's input stacked, and each kept result stacked."""
        x_all, c_all = self.split(tensors)

        def loop(inputs: List[Tensor], layer: Callable = self.recorded_layer) -> List[Tensor]:
            x, c = self.split(inputs[1:])
            carry = inputs[0]
            stacked = new_stacked(carry, self.length)
            kept_stacked: List[Tensor] = []
            for i in range(self.length):
                stacked[i].copy_(carry)
                new, kept = layer(carry, [t[i] for t in x], c)
                self.check(new, carry)
                if i == 0:
                    kept_stacked = [new_stacked(k, self.length) for k in kept]
                for buffer, k in zip(kept_stacked, kept):
                    buffer[i].copy_(k)
                carry = new
            return [carry, stacked, *kept_stacked]

        if self.on_xla:
            def body(h: Tensor, x_i: List[Tensor]) -> Tuple[Tensor, Tuple[Tensor, List[Tensor]]]:
                new, kept = self.recorded_layer(h, x_i, c_all)
                self.check(new, h)
                return new, (h, kept)

            out = xla_scan(body, carry, x_all)
            if out is not None:
                last, (stacked, kept_stacked) = out
                return (last, stacked, *kept_stacked)
        if not sharing():  # eagerly, or differentiated twice (grad of grad): plain ops
            return tuple(loop([carry, *tensors]))
        # The loop's outputs: what one layer keeps, learned without recording it in the step's graph.
        _, kept = run_untraced(self.recorded_layer, carry, [t[0] for t in x_all], c_all)
        outputs = [meta(carry), meta(carry, self.length), *(meta(k, self.length) for k in kept)]
        return tuple(run_loop(self.name, lambda ins: loop(ins, self.compiled_layer), [carry, *tensors], outputs))

    def backward(self, saved: Sequence[Tensor], tensors: Sequence[Tensor], grad: Tensor,
                 needs: Sequence[bool]) -> List[Optional[Tensor]]:
        """Gradients for the carry and each tensor of `xs` and `consts` that `needs` asks for.

        `saved` is the stacked layer inputs followed by the stacked kept results.
        """
        x_all, c_all = self.split(tensors)
        need_x = [i for i, t in enumerate(x_all) if needs[1 + i] and _differentiable(t)]
        need_c = [i for i, t in enumerate(c_all) if needs[1 + len(x_all) + i] and _differentiable(t)]
        # Replaying kept results needs the forward's transform exactly: differentiate what it did.
        replays = self.policy.saves_anything
        wrt_x, wrt_c = (_floating(x_all), _floating(c_all)) if replays else (need_x, need_c)
        layout = self.kept_layout

        def layer_vjp(carry: Tensor, kept: List[Tensor], x: List[Tensor], c: List[Tensor], g: Tensor):
            layer = self.layer_wrt(x, c, wrt_x, wrt_c)

            def pulled(carry: Tensor, *diff: Tensor) -> List[Tensor]:
                with Replay(unflatten_saved(*layout, kept)) if kept else contextlib.nullcontext():
                    return [layer(carry, list(diff[:len(wrt_x)]), list(diff[len(wrt_x):]))]

            g_carry, *g_diff = pull_back(pulled, [carry, *(x[i] for i in wrt_x), *(c[i] for i in wrt_c)], [g])
            g_x, g_c = g_diff[:len(wrt_x)], g_diff[len(wrt_x):]
            return (g_carry, [g_x[wrt_x.index(i)] for i in need_x], [g_c[wrt_c.index(i)] for i in need_c])

        n_saved = len(saved)

        def loop(inputs: List[Tensor], step: Callable = layer_vjp) -> List[Tensor]:
            stacked, kept = inputs[0], inputs[1:n_saved]
            (x, c), g = self.split(inputs[n_saved:-1]), inputs[-1]
            grads_x = [new_stacked(x[i][0], self.length) for i in need_x]
            grads_c: List[Any] = [None] * len(need_c)
            for i in reversed(range(self.length)):
                g, g_x, g_c = step(stacked[i], [k[i] for k in kept], [t[i] for t in x], c, g)
                for buffer, value in zip(grads_x, g_x):
                    buffer[i].copy_(value)
                grads_c = [b if a is None else a + b for a, b in zip(grads_c, g_c)]
            return [g, *grads_x, *grads_c]

        inputs = [*saved, *tensors, grad]
        results = None
        if self.on_xla:
            results = _backward_on_xla(layer_vjp, saved, x_all, c_all, grad, need_c)
        if results is None and sharing():
            outputs = [meta(grad)] + [meta(x_all[i]) for i in need_x] + [meta(c_all[i]) for i in need_c]
            compiled = Compiled(layer_vjp)  # one per traced backward: compiled on its first run
            results = run_loop(self.name + ".backward", lambda ins: loop(ins, compiled), inputs, outputs)
        if results is None:  # eagerly, or differentiated twice (grad of grad): plain, recorded
            results = loop(inputs)
        grads: List[Optional[Tensor]] = [None] * (1 + len(tensors))
        grads[0] = results[0]
        for j, i in enumerate(need_x):
            grads[1 + i] = results[1 + j]
        for j, i in enumerate(need_c):
            grads[1 + len(x_all) + i] = results[1 + len(need_x) + j]
        return grads


def _backward_on_xla(layer_vjp: Callable, saved: Sequence[Tensor], x: List[Tensor], c: List[Tensor],
                     grad: Tensor, need_c: List[int]) -> Optional[List[Tensor]]:
    """The backward loop as one XLA While over the layers in reverse (None where there is none)."""

    def body(state: Tuple[Tensor, List[Tensor]], xs_i: Tuple[List[Tensor], List[Tensor]]):
        (g, sums), (saved_i, x_i) = state, xs_i
        g, g_x, g_c = layer_vjp(saved_i[0], saved_i[1:], x_i, c, g)
        return (g, [a + b for a, b in zip(sums, g_c)]), list(g_x)

    flip = lambda t: torch.flip(t, [0])  # noqa: E731
    init = (grad, [torch.zeros_like(c[i]) for i in need_c])
    out = xla_scan(body, init, ([flip(t) for t in saved], [flip(t) for t in x]))
    if out is None:
        return None
    (g, sums), grads_x = out
    return [g, *(flip(t) for t in grads_x), *sums]


class _RematScan(torch.autograd.Function):
    """Forward: the last carry, then what the backward needs; backward: one recomputing loop."""

    @staticmethod
    def forward(plan: _Plan, carry: Tensor, *tensors: Tensor) -> Tuple[Tensor, ...]:
        return plan.forward(carry, tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, ...]) -> None:
        plan, _, *tensors = inputs
        ctx.plan, ctx.n_saved = plan, len(output) - 1
        ctx.save_for_backward(*output[1:], *tensors)
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx: Any, grad: Optional[Tensor], *_saved_grads: Any) -> Tuple[Optional[Tensor], ...]:
        needs, n = ctx.needs_input_grad[1:], ctx.n_saved
        if grad is None:
            grad = torch.zeros_like(ctx.saved_tensors[0][0])

        saved = ctx.saved_tensors
        return (None, *ctx.plan.backward(saved[:n], saved[n:], grad, needs))


def _xla_loop_possible(tensors: Sequence[Tensor]) -> bool:
    """On torch_xla, under no `torch.func` transform, and not inside another XLA loop's body."""
    return (all(t.device.type == "xla" for t in tensors) and not has_dtensor(list(tensors))
            and not any_transform_active() and not inside_xla_fold())


def remat_scan(fn: Callable[[Tensor, PyTree, PyTree], Tensor], carry: Tensor, xs: PyTree,
               consts: PyTree = None, *, policy: Union[str, RematPolicy, bool] = "full",
               name: str = "ember.remat_scan") -> Tensor:
    """The last carry of `fn(carry, x, consts)` over the slices `x` of `xs`, each call rematerialised.

    Args:
        fn: a pure layer `(carry, x, consts) -> carry` returning a tensor shaped like `carry`.
        carry: the first layer's input (a floating-point tensor).
        xs: pytrees of tensors with a leading layer dim (stacked parameters, per-layer keys).
        consts: what every layer sees (positions, masks, flags).
        policy: what each layer keeps besides its input (`ember.core.remat_policies`): `"full"`
            (nothing), `"dots_saveable"`, `"save:<tags>"`, ..., or `"none"` (everything: no recomputation).
        name: names the loops in the step's graph.

    Returns:
        The last layer's output.

    Raises:
        ValueError: an unknown policy (the nearest names are listed); at run time, a layer whose
            output is not shaped like its input.

    Example:
        >>> import torch
        >>> from ember.core.transforms import grad, remat_scan
        >>> layer = lambda h, w, _: torch.tanh(h @ w)
        >>> ws = torch.eye(2).expand(3, 2, 2).clone()
        >>> grad(lambda ws: remat_scan(layer, torch.ones(1, 2), ws).sum())(ws).shape
        torch.Size([3, 2, 2])
    """
    chosen = remat_policy(policy) or remat_policy("everything_saveable")
    xs_flat, consts_flat = Flat(xs), Flat(consts)
    # On torch_xla only a policy that keeps nothing rolls: replaying kept results inside torch_xla
    # 2.9's scan body fails functionalization ("isFunctionalTensor(base_)", measured on none and
    # dots_saveable); the others run unrolled there.
    on_xla = not chosen.saves_anything and _xla_loop_possible([carry, *xs_flat.tensors, *consts_flat.tensors])
    if not (on_xla or rolling((carry, xs, consts))):
        step = remat(lambda c, x, k: fn(c, x, k), policy=policy, shared=True)
        return scan(lambda c, x: (step(c, x, consts), None), carry, xs)[0]
    length = xs_flat.tensors[0].shape[0]
    plan = _Plan(fn, xs_flat, consts_flat, length, chosen, name, on_xla)
    return _RematScan.apply(plan, carry, *xs_flat.tensors, *consts_flat.tensors)[0]
