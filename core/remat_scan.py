"""`remat_scan`: layers applied one after the other, each rematerialised, as one loop each way.

Public name: `remat_scan` (also exported from `ember.core.transforms`).

`remat_scan(fn, carry, xs, consts, policy=...)` computes what `scan` of `remat(fn, policy=...)`
computes: the forward keeps each layer's input and what the policy names, and the backward
recomputes one layer at a time, handing the kept results back instead of recomputing them
(`remat_policies.Replay`). Policy `"none"` keeps what a plain layer's autograd graph keeps and
recomputes nothing (`everything_saveable`). Where it runs:

- in ember's Inductor step, the forward loop and the backward loop are each one `scan` node of the
  step's graph (`scan_rolled.py`, the kept results stacked as the forward's ys);
- on torch_xla with a policy that keeps nothing (`"full"`), each is one XLA `While` (below);
- elsewhere (eagerly, under Dynamo or `vmap`, with DTensor inputs) it is `scan` of
  `remat(fn, shared=True)`: the same numbers, the layers unrolled.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .autograd_grad import pull_back
from .compat.xla_loop import xla_scan
from .jit_backends.trace import FunctionError
from .pytree import tree_flatten, tree_unflatten
from .remat import _differentiable, remat
from .remat_policies import RematPolicy, remat_policy
from .scan import rolls_in_the_graph, scan, xla_loop_possible
from .scan_rolled import rolled_scan
from .trace_context import xla_loop_body
from .types import PyTree

__all__ = ["remat_scan"]


class _Flat:
    """A pytree split into its tensors (the loop's inputs) and everything else (kept as is)."""

    def __init__(self, tree: PyTree) -> None:
        leaves, self.spec = tree_flatten(tree)
        self.positions = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
        self.others = [None if isinstance(v, Tensor) else v for v in leaves]
        self.tensors: List[Tensor] = [leaves[i] for i in self.positions]

    def rebuild(self, tensors: Sequence[Tensor]) -> PyTree:
        leaves = list(self.others)
        for i, t in zip(self.positions, tensors):
            leaves[i] = t
        return tree_unflatten(leaves, self.spec)


def _loop(body: Callable[[Any, Any], Tuple[Any, Any]], init: Any, xs: Any) -> Tuple[Any, Any]:
    """One XLA `While` of `body` over `xs`; a Python loop where torch_xla has none (`xla_scan`)."""
    out = xla_scan(xla_loop_body(body), init, xs)
    return scan(body, init, xs, unroll=True) if out is None else out


class _XlaLayers:
    """The layer as a function of flat tensor lists, and its forward and backward as XLA `While`s.

    The carry is a list of tensors `h`; gradients flow through its floating ones (`diff_h`). The
    forward keeps each layer's input, stacked over layers; the backward walks back over them,
    recomputing each layer for its vector-Jacobian product (policy `"full"`).
    """

    def __init__(self, fn: Callable, carry: _Flat, xs: _Flat, consts: _Flat, name: str) -> None:
        self.fn, self.carry, self.xs, self.consts, self.name = fn, carry, xs, consts, name
        self.n_h, self.n_x = len(carry.tensors), len(xs.tensors)
        self.diff_h = _floating(carry.tensors)

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

    def forward(self, h: List[Tensor], x_all: List[Tensor], c: List[Tensor], keep: bool) -> List[Tensor]:
        """The last carry tensors, then (`keep`) each layer's input carry stacked over layers."""
        last, inputs = _loop(lambda h_i, x_i: (self.layer(h_i, x_i, c), list(h_i) if keep else []), list(h), x_all)
        return [*last, *inputs]

    def backward(self, inputs: Sequence[Tensor], x_all: List[Tensor], c: List[Tensor], grads_h: List[Tensor],
                 needs: Sequence[bool]) -> List[Optional[Tensor]]:
        """Gradients for the carry tensors and each tensor of `xs` and `consts` that `needs` asks for;
        `inputs` are the layers' input carries, `grads_h` the gradients of the last carry's floating tensors."""
        n_h, n_x, diff_h = self.n_h, self.n_x, self.diff_h
        need_x = [j for j, t in enumerate(x_all) if needs[n_h + j] and _differentiable(t)]
        need_c = [i for i, t in enumerate(c) if needs[n_h + n_x + i] and _differentiable(t)]

        def body(state: Tuple[List[Tensor], List[Tensor]], xs_i: Tuple[List[Tensor], List[Tensor]]):
            (g, sums), (h, x) = state, xs_i

            def pulled(*diff: Tensor) -> List[Tensor]:
                h_full, x_full, c_full = list(h), list(x), list(c)
                for positions, full, values in ((diff_h, h_full, diff[:len(diff_h)]),
                                                (need_x, x_full, diff[len(diff_h):len(diff_h) + len(need_x)]),
                                                (need_c, c_full, diff[len(diff_h) + len(need_x):])):
                    for i, t in zip(positions, values):
                        full[i] = t
                new = self.layer(h_full, x_full, c_full)
                return [new[i] for i in diff_h]

            primals = [*(h[i] for i in diff_h), *(x[j] for j in need_x), *(c[i] for i in need_c)]
            back = pull_back(pulled, primals, g)
            g_h, g_x, g_c = back[:len(diff_h)], back[len(diff_h):len(diff_h) + len(need_x)], back[len(diff_h) + len(need_x):]
            return (list(g_h), [a + b for a, b in zip(sums, g_c)]), list(g_x)

        flip = lambda t: torch.flip(t, [0])  # noqa: E731  XLA's While walks forward only
        init = (list(grads_h), [torch.zeros_like(c[i]) for i in need_c])
        (g, sums), grads_x = _loop(body, init, ([flip(t) for t in inputs], [flip(t) for t in x_all]))
        grads: List[Optional[Tensor]] = [None] * (n_h + n_x + len(c))
        for i, g_i in zip(diff_h, g):
            grads[i] = g_i
        for j, g_j in zip(need_x, grads_x):
            grads[n_h + j] = flip(g_j)
        for i, s in zip(need_c, sums):
            grads[n_h + n_x + i] = s
        return grads


class _XlaRematScan(torch.autograd.Function):
    """Forward: the last carry tensors, then each layer's input; backward: one recomputing loop."""

    @staticmethod
    def forward(layers: _XlaLayers, *tensors: Tensor) -> Tuple[Tensor, ...]:
        n_h, n_x = layers.n_h, layers.n_x
        h, x, c = list(tensors[:n_h]), list(tensors[n_h:n_h + n_x]), list(tensors[n_h + n_x:])
        return tuple(layers.forward(h, x, c, keep=True))

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, ...]) -> None:
        layers, *tensors = inputs
        ctx.layers = layers
        ctx.save_for_backward(*output[layers.n_h:], *tensors[layers.n_h:])
        ctx.mark_non_differentiable(*output[layers.n_h:], *(t for t in output[:layers.n_h] if not _differentiable(t)))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        layers, saved = ctx.layers, ctx.saved_tensors
        n_h, n_x = layers.n_h, layers.n_x
        inputs, x, c = saved[:n_h], list(saved[n_h:n_h + n_x]), list(saved[n_h + n_x:])
        grads_h = [torch.zeros_like(inputs[i][0]) if grads[i] is None else grads[i] for i in layers.diff_h]
        return (None, *layers.backward(inputs, x, c, grads_h, ctx.needs_input_grad[1:]))


def _floating(tensors: Sequence[Tensor]) -> List[int]:
    return [i for i, t in enumerate(tensors) if _differentiable(t)]


def _describe(tree: PyTree) -> str:
    leaves, _ = tree_flatten(tree)
    tensors = [f"{tuple(t.shape)} {t.dtype}" for t in leaves if isinstance(t, Tensor)]
    return tensors[0] if len(leaves) == 1 and tensors else f"{type(tree).__name__} of [{', '.join(tensors)}]"


def remat_scan(fn: Callable[[PyTree, PyTree, PyTree], PyTree], carry: PyTree, xs: PyTree,
               consts: PyTree = None, *, policy: Union[str, RematPolicy, bool] = "full",
               name: str = "ember.remat_scan") -> PyTree:
    """The last carry of `fn(carry, x, consts)` over the slices `x` of `xs`, each call rematerialised.

    Args:
        fn: a pure layer `(carry, x, consts) -> carry` returning a carry shaped like its input.
        carry: the first layer's input: a tensor, or a pytree of tensors (activations and what rides
            along with them, such as a mixture of experts' router statistics); at least one floating.
        xs: pytrees of tensors with a leading layer dim (stacked parameters, per-layer keys).
        consts: what every layer sees (positions, masks, flags).
        policy: what each layer keeps besides its input (`ember.core.remat_policies`): `"full"`
            (nothing), `"dots_saveable"`, `"save:<tags>"`, ..., or `"none"` (everything: no recomputation).
        name: names the loops in error messages.

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
    carry_flat, xs_flat, consts_flat = _Flat(carry), _Flat(xs), _Flat(consts)
    if not _floating(carry_flat.tensors):
        raise ValueError(f"{name}: the carry has no floating-point tensor ({_describe(carry)}); remat_scan "
                         "differentiates through the carry: pass the activations in it.")
    tensors = [*carry_flat.tensors, *xs_flat.tensors, *consts_flat.tensors]
    # On torch_xla only a policy that keeps nothing rolls: replaying kept results inside torch_xla
    # 2.9's scan body fails functionalization ("isFunctionalTensor(base_)", measured on none and
    # dots_saveable); the others run unrolled there.
    if not chosen.saves_anything and xla_loop_possible(tensors):
        layers = _XlaLayers(fn, carry_flat, xs_flat, consts_flat, name)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            out = _XlaRematScan.apply(layers, *tensors)
        else:
            n_h, n_x = layers.n_h, layers.n_x
            out = layers.forward(tensors[:n_h], tensors[n_h:n_h + n_x], tensors[n_h + n_x:], keep=False)
        return carry_flat.rebuild(out[:layers.n_h])
    length = xs_flat.tensors[0].shape[0]
    if rolls_in_the_graph(carry, xs, length):
        rolled = rolled_scan(lambda c, x, k: (fn(c, x, k), None), carry, xs, length, False, consts, policy=chosen)
        if rolled is not None:
            return rolled[0]
    step = remat(fn, policy=policy, shared=True)
    return scan(lambda c, x: (step(c, x, consts), None), carry, xs, unroll=True)[0]  # each layer's remat
