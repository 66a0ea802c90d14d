"""`remat_scan`: layers applied one after the other, each rematerialised, as one loop each way.

Public name: `remat_scan` (also exported from `ember.core.transforms`).

`remat_scan(fn, carry, xs, consts, policy=...)` computes what `scan` of `remat(fn, policy=...)`
computes: the forward keeps each layer's input and what the policy names, and the backward
recomputes one layer at a time, handing the kept results back instead of recomputing them
(`remat_policies.Replay`). Policy `"none"` keeps what a plain layer's autograd graph keeps but its
elementwise results, which the backward rebuilds from the results they come from, as torch.compile's
partitioner does; no matmul, attention or reduction runs twice (`remat_policies.NO_REMAT`). Where it runs:

- in ember's Inductor step, the forward loop and the backward loop are each one `scan` node of the
  step's graph (`scan_rolled.py`, the kept results stacked as the forward's ys), DTensors included;
- on torch_xla with a policy that keeps nothing (`"full"`), each is one XLA `While` (below); with
  `"none"` (the default), outside SPMD, it is torch_xla's differentiable `scan` (`_kept_on_xla`), whose
  AOTAutograd backward keeps what a plain layer's keeps; the other cases run unrolled there;
- elsewhere (eagerly, under Dynamo or `vmap`) it is `scan` of
  `remat(fn, shared=True)`: the same numbers, the layers unrolled.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .autograd_grad import pull_back
from .compat.xla_loop import xla_scan
from .pytree import tree_flatten, tree_unflatten
from .remat import _differentiable, remat
from .remat_policies import NO_REMAT, RematPolicy, remat_policy
from .scan import rolls_in_the_graph, scan, xla_loop_possible
from .scan_rolled import rolled_scan
from .trace_context import FunctionError, xla_loop_body
from .types import PyTree

__all__ = ["remat_scan"]


class _Flat:
    """A pytree split into its tensors (the loop's inputs) and everything else (kept as is)."""

    def __init__(self, tree: PyTree) -> None:
        leaves, self.spec = tree_flatten(tree)
        self.positions = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
        self.others = [None if isinstance(v, Tensor) else v for v in leaves]
        self.tensors: List[Tensor] = [leaves[i] for i in self.positions]

    def structure(self) -> "_Flat":
        """This split without its tensors (what `rebuild` needs, holding no tensor alive)."""
        empty = _Flat(None)
        empty.spec, empty.positions, empty.others = self.spec, self.positions, self.others
        return empty

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


_BODIES: "collections.OrderedDict[Any, Callable]" = collections.OrderedDict()
"""Bodies of `_kept_on_xla` by what they compute (the layer and the trees' structure): torch_xla keeps the
trace of a pure body by its identity, and the step's Python runs again every step on torch_xla."""


def _kept_body(fn: Callable, xs: _Flat, consts: _Flat) -> Tuple[Callable, bool]:
    """The scan body of `fn` over `xs` then `consts`'s tensors, and whether it is the one kept for them."""
    n_x, xs, consts = len(xs.tensors), xs.structure(), consts.structure()

    def body(h: PyTree, sliced: List[Tensor]) -> Tuple[PyTree, Tuple[()]]:
        return fn(h, xs.rebuild(sliced[:n_x]), consts.rebuild(sliced[n_x:])), ()

    try:  # a partial of a layer (hashable modules, as Stacked passes) names what it computes; a closure does not
        key = (fn.func, fn.args, tuple(sorted(fn.keywords.items())), xs.spec, tuple(xs.others), consts.spec,
               tuple(consts.others)) if isinstance(fn, functools.partial) else None
        hash(key)
    except TypeError:
        key = None
    if key is None:
        return xla_loop_body(body), False
    if key not in _BODIES:
        _BODIES[key] = xla_loop_body(body)
        while len(_BODIES) > 64:
            _BODIES.popitem(last=False)
    return _BODIES[key], True


def _spmd() -> bool:
    """Whether torch_xla runs SPMD: AOTAutograd's fake tensors take no sharding annotation ("Expected XLA
    tensor"), so `_kept_on_xla` runs on one device only."""
    import torch_xla.runtime as xr

    return xr.is_spmd()


def _kept_on_xla(fn: Callable, carry: PyTree, xs: _Flat, consts: _Flat, length: int) -> PyTree:
    """Policy `"none"` on torch_xla: torch_xla's differentiable `scan`, whose AOTAutograd backward keeps
    what a plain layer's keeps. The tensors of `consts` ride in `xs`, broadcast over the layers (a view):
    the body closes over no tensor, and their gradients sum over the layers."""
    from torch_xla.experimental.scan import scan as xla_differentiable_scan

    body, kept = _kept_body(fn, xs, consts)
    broadcast = [t.expand(length, *t.shape) for t in consts.tensors]
    return xla_differentiable_scan(body, carry, [*xs.tensors, *broadcast], is_fn_pure=kept)[0]


def remat_scan(fn: Callable[[PyTree, PyTree, PyTree], PyTree], carry: PyTree, xs: PyTree,
               consts: PyTree = None, *, policy: Union[str, RematPolicy, bool] = "full",
               name: str = "ember.remat_scan", length: Optional[int] = None) -> PyTree:
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
        length: the number of layers, where `xs` has no tensor (layers without parameters or keys).

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
    chosen = remat_policy(policy) or NO_REMAT
    carry_flat, xs_flat, consts_flat = _Flat(carry), _Flat(xs), _Flat(consts)
    if not _floating(carry_flat.tensors):
        raise ValueError(f"{name}: the carry has no floating-point tensor ({_describe(carry)}); remat_scan "
                         "differentiates through the carry: pass the activations in it.")
    tensors = [*carry_flat.tensors, *xs_flat.tensors, *consts_flat.tensors]
    if xs_flat.tensors:
        length = xs_flat.tensors[0].shape[0]
    elif length is None:
        raise ValueError(f"{name}: `xs` has no tensor to count the layers by; pass length=<number of layers>.")
    # On torch_xla, "none" rolls through torch_xla's own differentiable scan and "full" through ember's two
    # Whiles; replaying kept results inside torch_xla 2.9's scan body fails functionalization
    # ("isFunctionalTensor(base_)", measured on none and dots_saveable): the other policies run unrolled there.
    if (chosen.everything and xs_flat.tensors and xla_loop_possible(tensors) and not _spmd()
            and all(_differentiable(t) for t in carry_flat.tensors)):
        return _kept_on_xla(fn, carry, xs_flat, consts_flat, length=length)
    if not chosen.saves_anything and xs_flat.tensors and xla_loop_possible(tensors):
        layers = _XlaLayers(fn, carry_flat, xs_flat, consts_flat, name)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            out = _XlaRematScan.apply(layers, *tensors)
        else:
            n_h, n_x = layers.n_h, layers.n_x
            out = layers.forward(tensors[:n_h], tensors[n_h:n_h + n_x], tensors[n_h + n_x:], keep=False)
        return carry_flat.rebuild(out[:layers.n_h])
    if rolls_in_the_graph(carry, xs, length):
        rolled = rolled_scan(lambda c, x, k: (fn(c, x, k), None), carry, xs, length, False, consts, policy=chosen)
        if rolled is not None:
            return rolled[0]
    step = remat(lambda c, x, k: fn(c, x, k), policy=policy, shared=True)  # a lambda: Dynamo cannot wrap a partial
    return scan(lambda c, x: (step(c, x, consts), None), carry, xs, length=length, unroll=True)[0]  # each layer's remat
