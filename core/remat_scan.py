"""`remat_scan`: layers applied one after the other, each rematerialised, as one loop each way.

Public name: `remat_scan` (also exported from `ember.core.transforms`).

`remat_scan(fn, carry, xs, consts, policy=...)` computes what `scan` of `remat(fn, policy=...)`
computes: the forward keeps each layer's input and what the policy names (layer by layer; stacked
over layers in torch_xla's While), and the backward recomputes one layer at a time, handing the kept
results back instead of recomputing them (`remat_policies.Replay`). Policy `"none"` keeps what a
plain layer's autograd graph keeps and recomputes nothing (`everything_saveable`). In ember's
Inductor step the forward loop and the backward loop are each one `scan` node of the step's graph
(`scan_rolled.py`, the kept results stacked as the forward's ys); `per_layer` layers, each one
`ember::rolled_loop` node (`rolled_loop.py`, a layer's forward and its vjp compiled once, apart from the
step). Either way the step's compile time does not grow with depth. On torch_xla, with a policy that keeps nothing
(`"full"`), they are XLA `While`s. Elsewhere (eagerly, under Dynamo or `vmap`, with DTensor inputs)
it is `scan` of `remat(fn, shared=True)`: the same numbers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .autograd_grad import pull_back, run_differentiated
from .compat.shared_subgraph import run_untraced, sharing
from .compat.xla_loop import xla_scan
from .jit_backends.trace import FunctionError
from .pytree import tree_flatten
from .remat import _differentiable, remat
from .remat_policies import Record, RematPolicy, Replay, flatten_saved, remat_policy, unflatten_saved
from .rolled_loop import Compiled, Flat, meta, new_stacked, rolling, run_loop
from .scan import rolls_in_the_graph, scan, xla_loop_possible
from .scan_rolled import rolled_scan
from .types import PyTree

__all__ = ["remat_scan"]


def _floating(tensors: Sequence[Tensor]) -> List[int]:
    return [i for i, t in enumerate(tensors) if _differentiable(t)]


class _Plan:
    """The layer as a function of flat tensor lists, and its forward and backward loops.

    The carry is a list of tensors `h` (the leaves of the carry's pytree); gradients flow through
    its floating ones (`self.diff_h`). Saved for the backward, layer by layer: each layer's carry
    tensors, then what the policy kept (laid out as `kept_layout`); returning them as they are,
    rather than copied into buffers stacked over layers, saves a copy of every kept result.
    """

    def __init__(self, fn: Callable, carry: Flat, xs: Flat, consts: Flat, length: int, policy: RematPolicy,
                 name: str, on_xla: bool, per_layer: bool = False, differentiated: bool = True) -> None:
        self.fn, self.carry, self.xs, self.consts, self.length, self.name = fn, carry, xs, consts, length, name
        # per_layer: `xs` holds one layer's tensors, and the loops get every layer's, one layer after
        # the other; otherwise its tensors are stacked over layers
        self.per_layer = per_layer
        self.differentiated = differentiated  # False: no backward will run, the forward keeps nothing
        self.policy, self.on_xla = policy, on_xla  # on_xla: the loops are XLA Whiles
        self.n_h = len(carry.tensors)
        self.diff_h = _floating(carry.tensors)
        self.kept_layout: Any = ([], [])
        self.saved_stacked = False  # whether `forward` returned what it saved stacked over layers (XLA)
        self.compiled_layer = Compiled(self.recorded_layer)
        self.traced = False  # whether the layers run as traced bodies (unused recomputation is dead code)

    def layer(self, h: List[Tensor], x: List[Tensor], c: List[Tensor]) -> List[Tensor]:
        out = self.fn(self.carry.rebuild(h), self.xs.rebuild(x), self.consts.rebuild(c))
        leaves, spec = tree_flatten(out)
        new = [v for v in leaves if isinstance(v, Tensor)]
        if spec != self.carry.spec or len(new) != len(h) or any(
                a.shape != b.shape or a.dtype != b.dtype for a, b in zip(new, h)):
            raise FunctionError(
                f"{self.name}: the layer returned {_describe(out)} for a carry of {_describe(self.carry.rebuild(h))}; "
                "a scanned layer must return a carry shaped like its input (project in a layer outside the stack).")
        return new

    def layer_wrt(self, h: List[Tensor], x: List[Tensor], c: List[Tensor], wrt_x: List[int],
                  wrt_c: List[int]) -> Callable[..., List[Tensor]]:
        """The layer's carry tensors as a function of the floating carry tensors, then the `wrt_x` /
        `wrt_c` tensors of `x` and `c`."""
        diff_h, n_x = self.diff_h, len(wrt_x)

        def pulled(*diff: Tensor) -> List[Tensor]:
            h_full, x_full, c_full = list(h), list(x), list(c)
            for positions, full, values in ((diff_h, h_full, diff[:len(diff_h)]),
                                            (wrt_x, x_full, diff[len(diff_h):len(diff_h) + n_x]),
                                            (wrt_c, c_full, diff[len(diff_h) + n_x:])):
                for i, t in zip(positions, values):
                    full[i] = t
            return self.layer(h_full, x_full, c_full)

        return pulled

    def primals(self, h: List[Tensor], x: List[Tensor], c: List[Tensor], wrt_x: List[int],
                wrt_c: List[int]) -> List[Tensor]:
        return [*(h[i] for i in self.diff_h), *(x[i] for i in wrt_x), *(c[i] for i in wrt_c)]

    def recorded_layer(self, h: List[Tensor], x: List[Tensor], c: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        """The layer's carry tensors and what the policy keeps of this call.

        Run differentiated, as the backward replays it: an op's decomposition may depend on whether
        its inputs are differentiated (SDPA, matmul), and `Replay` matches results to ops by their
        order, so both must see the same ops (measured: a [.., 192] result handed to an op
        expecting [.., 512] when the forward ran plainly).
        """
        if not (self.policy.saves_anything and self.differentiated):
            return self.layer(h, x, c), []
        wrt_x, wrt_c = _floating(x), _floating(c)
        layer = self.layer_wrt(h, x, c, wrt_x, wrt_c)

        def recorded(*diff: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
            with Record(self.policy, only_what_autograd_saves=self.traced) as record:
                new = layer(*diff)
            keys, structures, kept = flatten_saved(record.saved)
            self.kept_layout = (keys, structures)
            passed = set(map(id, diff))  # a compiled body may not return its input
            return new, [t.clone() if id(t) in passed else t for t in kept]

        return run_differentiated(recorded, self.primals(h, x, c, wrt_x, wrt_c))

    def split(self, tensors: Sequence[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        n = len(self.xs.tensors) * (self.length if self.per_layer else 1)
        return list(tensors[:n]), list(tensors[n:])

    def at(self, x_all: Sequence[Tensor], i: int) -> List[Tensor]:
        """Layer `i`'s tensors of `xs`."""
        if self.per_layer:
            width = len(self.xs.tensors)
            return list(x_all[i * width:(i + 1) * width])
        return [t[i] for t in x_all]

    def x_position(self, i: int, j: int) -> int:
        """Where layer `i`'s `j`-th tensor of `xs` is among the loop's `xs` inputs (stacked: `j`)."""
        return i * len(self.xs.tensors) + j if self.per_layer else j

    def forward(self, h: List[Tensor], tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """The last carry tensors, then what the backward needs of each layer (`layer_saved`): its
        carry tensors and what the policy kept, layer after layer; on torch_xla each stacked over layers."""
        x_all, c_all = self.split(tensors)
        n_h = self.n_h

        def loop(inputs: List[Tensor], layer: Callable = self.recorded_layer) -> List[Tensor]:
            h, (x, c) = inputs[:n_h], self.split(inputs[n_h:])
            saved: List[Tensor] = []
            for i in range(self.length):
                new, kept = layer(h, self.at(x, i), c)
                saved += [*h, *kept] if self.differentiated else []
                h = new
            return [*h, *saved]

        if self.on_xla:
            def body(h_i: List[Tensor], x_i: List[Tensor]) -> Tuple[List[Tensor], Tuple[List[Tensor], List[Tensor]]]:
                new, kept = self.recorded_layer(h_i, x_i, c_all)
                return new, (h_i, kept)

            out = xla_scan(body, list(h), x_all)
            if out is not None:
                last, (stacked, kept_stacked) = out
                self.saved_stacked = True
                return (*last, *stacked, *kept_stacked)
        if not sharing():  # eagerly, or differentiated twice (grad of grad): plain ops
            return tuple(loop([*h, *tensors]))
        self.traced = True
        # The loop's outputs: what one layer keeps, learned without recording it in the step's graph
        # (and in the caller's context, where a layer's checks of it raise).
        _, kept = run_untraced(self.recorded_layer, list(h), self.at(x_all, 0), c_all)
        outputs = [*map(meta, h), *[meta(t) for t in (*h, *kept)] * (self.length if self.differentiated else 0)]
        return tuple(run_loop(self.name, lambda ins: loop(ins, self.compiled_layer), [*h, *tensors], outputs))

    def layer_saved(self, saved: Sequence[Tensor], i: int) -> Tuple[List[Tensor], List[Tensor]]:
        """Layer `i`'s carry tensors and kept results, out of what `forward` returned for the backward."""
        if self.saved_stacked:
            return [t[i] for t in saved[:self.n_h]], [k[i] for k in saved[self.n_h:]]
        width = len(saved) // self.length  # each layer's carry tensors, then its kept results
        layer = saved[i * width:(i + 1) * width]
        return list(layer[:self.n_h]), list(layer[self.n_h:])

    def backward(self, saved: Sequence[Tensor], tensors: Sequence[Tensor], grads_h: List[Tensor],
                 needs: Sequence[bool]) -> List[Optional[Tensor]]:
        """Gradients for the carry tensors and each tensor of `xs` and `consts` that `needs` asks for.

        `saved` is what `forward` returned for the backward (`layer_saved`); `grads_h` the
        gradients of the last carry's floating tensors.
        """
        n_h, diff_h = self.n_h, self.diff_h
        x_all, c_all = self.split(tensors)
        first, layers = self.at(x_all, 0), range(self.length if self.per_layer else 1)
        need_x = [j for j, t in enumerate(first) if _differentiable(t) and any(
            needs[n_h + self.x_position(i, j)] for i in layers)]
        need_c = [i for i, t in enumerate(c_all) if needs[n_h + len(x_all) + i] and _differentiable(t)]
        # Replaying kept results needs the forward's transform exactly: differentiate what it did.
        replays = self.policy.saves_anything
        wrt_x, wrt_c = (_floating(first), _floating(c_all)) if replays else (need_x, need_c)
        layout = self.kept_layout

        def layer_vjp(h: List[Tensor], kept: List[Tensor], x: List[Tensor], c: List[Tensor], g: List[Tensor]):
            layer = self.layer_wrt(h, x, c, wrt_x, wrt_c)

            def pulled(*diff: Tensor) -> List[Tensor]:
                with Replay(unflatten_saved(*layout, kept)) if kept else contextlib.nullcontext():
                    new = layer(*diff)
                return [new[i] for i in diff_h]

            pulled_back = pull_back(pulled, self.primals(h, x, c, wrt_x, wrt_c), g)
            g_h, g_x = pulled_back[:len(diff_h)], pulled_back[len(diff_h):len(diff_h) + len(wrt_x)]
            g_c = pulled_back[len(diff_h) + len(wrt_x):]
            return (g_h, [g_x[wrt_x.index(i)] for i in need_x], [g_c[wrt_c.index(i)] for i in need_c])

        n_saved = len(saved)

        def loop(inputs: List[Tensor], step: Callable = layer_vjp) -> List[Tensor]:
            saved_in, n_in = inputs[:n_saved], len(inputs) - len(diff_h)
            (x, c), g = self.split(inputs[n_saved:n_in]), inputs[n_in:]
            per_layer: List[List[Tensor]] = [[] for _ in range(self.length)]
            grads_x = [] if self.per_layer else [new_stacked(x[i][0], self.length) for i in need_x]
            grads_c: List[Any] = [None] * len(need_c)
            for i in reversed(range(self.length)):
                g, g_x, g_c = step(*self.layer_saved(saved_in, i), self.at(x, i), c, g)
                if self.per_layer:
                    per_layer[i] = g_x
                for buffer, value in zip(grads_x, g_x):
                    buffer[i].copy_(value)
                grads_c = [b if a is None else a + b for a, b in zip(grads_c, g_c)]
            return [*g, *grads_x, *(t for layer in per_layer for t in layer), *grads_c]

        inputs = [*saved, *tensors, *grads_h]
        results = None
        if self.saved_stacked:
            results = _backward_on_xla(layer_vjp, saved, n_h, x_all, c_all, grads_h, need_c)
        if results is None and sharing():
            outputs = [*map(meta, grads_h), *(meta(x_all[self.x_position(i, j)]) for i in layers for j in need_x),
                       *(meta(c_all[i]) for i in need_c)]
            compiled = Compiled(layer_vjp)  # one per traced backward: compiled on its first run
            results = run_loop(self.name + ".backward", lambda ins: loop(ins, compiled), inputs, outputs)
        if results is None:  # eagerly, or differentiated twice (grad of grad): plain, recorded
            results = loop(inputs)
        grads: List[Optional[Tensor]] = [None] * (n_h + len(tensors))
        for j, i in enumerate(diff_h):
            grads[i] = results[j]
        at = len(diff_h)
        for i in layers:
            for j in need_x:
                grads[n_h + self.x_position(i, j)], at = results[at], at + 1
        for j, i in enumerate(need_c):
            grads[n_h + len(x_all) + i] = results[at + j]
        return grads


def _describe(tree: PyTree) -> str:
    leaves, _ = tree_flatten(tree)
    tensors = [f"{tuple(t.shape)} {t.dtype}" for t in leaves if isinstance(t, Tensor)]
    return tensors[0] if len(leaves) == 1 and tensors else f"{type(tree).__name__} of [{', '.join(tensors)}]"


def _backward_on_xla(layer_vjp: Callable, saved: Sequence[Tensor], n_h: int, x: List[Tensor], c: List[Tensor],
                     grads_h: List[Tensor], need_c: List[int]) -> Optional[List[Tensor]]:
    """The backward loop as one XLA While over the layers in reverse (None where there is none)."""

    def body(state: Tuple[List[Tensor], List[Tensor]], xs_i: Tuple[List[Tensor], List[Tensor]]):
        (g, sums), (saved_i, x_i) = state, xs_i
        g, g_x, g_c = layer_vjp(saved_i[:n_h], saved_i[n_h:], x_i, c, g)
        return (g, [a + b for a, b in zip(sums, g_c)]), list(g_x)

    flip = lambda t: torch.flip(t, [0])  # noqa: E731
    init = (list(grads_h), [torch.zeros_like(c[i]) for i in need_c])
    out = xla_scan(body, init, ([flip(t) for t in saved], [flip(t) for t in x]))
    if out is None:
        return None
    (g, sums), grads_x = out
    return [*g, *(flip(t) for t in grads_x), *sums]


class _RematScan(torch.autograd.Function):
    """Forward: the last carry tensors, then what the backward needs; backward: one recomputing loop."""

    @staticmethod
    def forward(plan: _Plan, *tensors: Tensor) -> Tuple[Tensor, ...]:
        return plan.forward(list(tensors[:plan.n_h]), tensors[plan.n_h:])

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, ...]) -> None:
        plan, *tensors = inputs
        ctx.plan, ctx.n_saved = plan, len(output) - plan.n_h
        ctx.save_for_backward(*output[plan.n_h:], *tensors[plan.n_h:])
        ctx.mark_non_differentiable(*output[plan.n_h:], *(t for t in output[:plan.n_h] if not _differentiable(t)))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        plan, n, saved = ctx.plan, ctx.n_saved, ctx.saved_tensors
        first = plan.layer_saved(saved[:n], 0)[0]
        grads_h = [torch.zeros_like(first[i]) if grads[i] is None else grads[i] for i in plan.diff_h]
        return (None, *plan.backward(saved[:n], saved[n:], grads_h, ctx.needs_input_grad[1:]))


def _needs_grad(tensors: Sequence[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _run(plan: _Plan, tensors: Sequence[Tensor]) -> Sequence[Tensor]:
    """The loops' outputs (the last carry tensors first); the forward alone where nothing is differentiated."""
    if plan.differentiated:
        return _RematScan.apply(plan, *tensors)
    return plan.forward(list(tensors[:plan.n_h]), tensors[plan.n_h:])


def remat_scan(fn: Callable[[PyTree, PyTree, PyTree], PyTree], carry: PyTree, xs: PyTree,
               consts: PyTree = None, *, policy: Union[str, RematPolicy, bool] = "full",
               name: str = "ember.remat_scan", per_layer: bool = False) -> PyTree:
    """The last carry of `fn(carry, x, consts)` over the slices `x` of `xs`, each call rematerialised.

    Args:
        fn: a pure layer `(carry, x, consts) -> carry` returning a carry shaped like its input.
        carry: the first layer's input: a tensor, or a pytree of tensors (activations and what rides
            along with them, such as a mixture of experts' router statistics); at least one floating.
        xs: pytrees of tensors with a leading layer dim (stacked parameters, per-layer keys).
        consts: what every layer sees (positions, masks, flags).
        policy: what each layer keeps besides its input (`ember.core.remat_policies`): `"full"`
            (nothing), `"dots_saveable"`, `"save:<tags>"`, ..., or `"none"` (everything: no recomputation).
        name: names the loops in the step's graph.
        per_layer: `xs` is a list with one pytree per layer, all alike (a `Sequential`'s params),
            instead of stacked. Each layer's tensors enter the loops as they are: no stacked copy.
            The loops roll only in ember's Inductor step; elsewhere the layers run one after the other.

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
    if per_layer:
        return _remat_layers(fn, carry, list(xs), consts, chosen, policy, name)
    carry_flat, xs_flat, consts_flat = Flat(carry), Flat(xs), Flat(consts)
    if not _floating(carry_flat.tensors):
        raise ValueError(f"{name}: the carry has no floating-point tensor ({_describe(carry)}); remat_scan "
                         "differentiates through the carry: pass the activations in it.")
    # On torch_xla only a policy that keeps nothing rolls: replaying kept results inside torch_xla
    # 2.9's scan body fails functionalization ("isFunctionalTensor(base_)", measured on none and
    # dots_saveable); the others run unrolled there.
    all_tensors = [*carry_flat.tensors, *xs_flat.tensors, *consts_flat.tensors]
    on_xla = not chosen.saves_anything and xla_loop_possible(all_tensors)
    length = xs_flat.tensors[0].shape[0]
    if not on_xla and rolls_in_the_graph(carry, xs, length):
        rolled = rolled_scan(lambda c, x, k: (fn(c, x, k), None), carry, xs, length, False, consts, policy=chosen)
        if rolled is not None:
            return rolled[0]
    if not (on_xla or rolling((carry, xs, consts))):
        step = remat(lambda c, x, k: fn(c, x, k), policy=policy, shared=True)
        return scan(lambda c, x: (step(c, x, consts), None), carry, xs, unroll=True)[0]  # each layer's remat
    plan = _Plan(fn, carry_flat, xs_flat, consts_flat, length, chosen, name, on_xla,
                 differentiated=_needs_grad(all_tensors))
    out = _run(plan, all_tensors)
    return carry_flat.rebuild(out[:plan.n_h])


_PLAIN_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _remat_layers(fn: Callable, carry: PyTree, xs: List[PyTree], consts: PyTree, chosen: RematPolicy,
                  policy: Union[str, RematPolicy, bool], name: str) -> PyTree:
    """`remat_scan(..., per_layer=True)`: one rolled loop each way over the layers' own tensors,
    where the loops roll and the layers are alike; otherwise the layers one after the other."""
    carry_flat, consts_flat = Flat(carry), Flat(consts)
    layers = [Flat(x) for x in xs]
    first = layers[0]
    alike = all(layer.spec == first.spec and layer.others == first.others and all(
        a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and a.requires_grad == b.requires_grad
        for a, b in zip(layer.tensors, first.tensors)) for layer in layers)
    # an object among the consts (a KV cache's call, which each layer writes to) cannot be shared by
    # a body compiled once: such layers run one after the other
    plain = all(isinstance(v, _PLAIN_VALUES) for v in consts_flat.others)
    if not (alike and plain and len(layers) > 1 and first.tensors and _floating(carry_flat.tensors)
            and rolling((carry, xs, consts))):
        step = remat(fn, policy=policy)
        for x in xs:
            carry = step(carry, x, consts)
        return carry
    tensors = [*carry_flat.tensors, *(t for layer in layers for t in layer.tensors), *consts_flat.tensors]
    plan = _Plan(fn, carry_flat, first, consts_flat, len(layers), chosen, name, on_xla=False, per_layer=True,
                 differentiated=_needs_grad(tensors))
    out = _run(plan, tensors)
    return carry_flat.rebuild(out[:plan.n_h])
