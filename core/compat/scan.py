"""torch's `scan` operator, called as the higher-order op itself.

`torch_scan` records one `scan` node of ember's traced step (`torch._higher_order_ops.scan.scan_op`,
private since it came, pytorch/pytorch#135603 and its stack) whose body is a subgraph, which Inductor
lowers to a loop writing each step's outputs into buffers preallocated for every step. Called under
ember's `make_fx` trace, the op traces its body with `make_fx` too, once, as `jax.lax.scan` traces its
body to a jaxpr: the body's Python runs once, ember's dispatch modes act inside it, and its sizes are
the trace's (static). torch's public wrapper, `torch._higher_order_ops.scan.scan`, would instead trace
the body with Dynamo (`torch.compile(fullgraph=True)`), which rejects a body with a Python side effect
or an active dispatch mode and, on one code object for every loop of the process, makes a later loop's
sizes symbols (pytorch/pytorch#166525).

A body traced by `make_fx` keeps a tensor it closes over as a constant: every tensor of the trace it
reads must come in through `init`, `xs` or `consts` (the op's `additional_inputs`); `in_the_graph` tells a
tensor of the trace from one made while nothing was recorded (a dry run). The op's inputs may not alias: a
tensor that shares its storage with an earlier one is copied. After the trace, `drop_unread_inputs` takes
out of each loop the inputs its body never reads (the node's arguments are the op's private layout).
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

__all__ = ["drop_unread_inputs", "in_the_graph", "torch_scan"]

Step = Callable[[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]],
                Tuple[List[torch.Tensor], List[torch.Tensor]]]


def torch_scan(step: Step, init: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], consts: Sequence[torch.Tensor],
               *, reverse: bool) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """`step(carry, x, consts) -> (carry, ys)` over dim 0 of `xs` (flat lists; `xs` not empty), one node
    of the traced graph. `ys[i]` comes from `xs[i]`, also with `reverse` (the ys are flipped at the end)."""
    from torch._higher_order_ops.scan import scan_op

    n_c, n_x = len(init), len(xs)

    # The op traces its body below autograd; a body that takes gradients itself (a microbatch's
    # `value_and_grad`) needs its caller's dispatch keys back, or every gradient it takes is silently zero.
    keys = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())

    placeholder = []  # Inductor on torch 2.9 to 2.13 fails on a loop without ys ("getitem is not an
    # OpOverload", measured; 2.15 lowers it): such a body returns one 0-d y, dropped here

    def body(*flat: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        # values, as the loop will pass them: the op may call the body on its own inputs (its fake-tensor
        # rule), which may require grad, and a gradient taken in the body would then be recorded
        flat = tuple(t.detach() for t in flat)
        n_sliced = 1 if reverse else n_x
        carry, x, k = list(flat[:n_c]), list(flat[n_c:n_c + n_sliced]), list(flat[n_c + n_sliced:])
        if reverse:  # the step's index, then the stacked xs at the end of the consts: read the slice there
            at = x[0].reshape(1)
            x, k = [t.index_select(0, at).squeeze(0) for t in k[len(k) - n_x:]], k[:len(k) - n_x]
        with torch._C._ForceDispatchKeyGuard(*keys):
            new, ys = step(carry, x, k)
        placeholder[:] = [] if ys else [new[0].new_zeros(())]
        return (*new, *ys, *placeholder)

    init, xs, consts = _split(_distinct([*init, *xs, *consts]), n_c, n_x)
    if reverse:
        # Walk an index backwards instead of flipping `xs`: a flip copies every stacked input (a backward's
        # saved activations and the layers' weights, measured 1.67x the unrolled step's peak memory at 125M).
        length = xs[0].shape[0]
        xs, consts = [torch.arange(length - 1, -1, -1, device=xs[0].device)], [*consts, *xs]
    out = scan_op(body, init, xs, tuple(consts))
    carry, ys = list(out[:n_c]), list(out[n_c:len(out) - len(placeholder)])
    return carry, [y.flip([0]) for y in ys] if reverse else ys


def _distinct(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """`tensors`, a copy where one shares its storage with an earlier one (the same tensor again, views of
    one base such as a model's router statistics): the op's inputs may not alias."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen: set = set()
    out = []
    for t in tensors:
        storage = StorageWeakRef(t.untyped_storage())
        out.append(t.clone() if storage in seen else t)
        seen.add(storage)
    return out


def _split(tensors: List[torch.Tensor], n_c: int, n_x: int) -> Tuple[List[torch.Tensor], ...]:
    return tensors[:n_c], tensors[n_c:n_c + n_x], tensors[n_c + n_x:]


def drop_unread_inputs(gm: torch.fx.GraphModule) -> None:
    """Take out of each `scan` node of `gm` the sliced and constant inputs its body does not read, as JAX's scan
    drops dead inputs: a stack of layers that draws nothing still gets its per-layer keys, and the loop would
    keep them, and the graph that makes them, alive. A loop keeps one sliced input (its length)."""
    from torch._higher_order_ops.scan import scan_op

    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not scan_op:
            continue
        body_attr, init, xs, consts = node.args[:4]
        body = getattr(gm, body_attr.target)
        drop_unread_inputs(body)  # loops inside the body first
        body.graph.eliminate_dead_code()
        places = [n for n in body.graph.nodes if n.op == "placeholder"]
        n_c, n_x = len(init), len(xs)
        keep_x = [i for i in range(n_x) if places[n_c + i].users] or [0]
        keep_k = [j for j in range(len(consts)) if places[n_c + n_x + j].users]
        if len(keep_x) == n_x and len(keep_k) == len(consts):
            continue
        kept = {*range(n_c), *(n_c + i for i in keep_x), *(n_c + n_x + j for j in keep_k)}
        for k, place in enumerate(places):
            if k not in kept:
                body.graph.erase_node(place)
        body.recompile()
        node.args = (body_attr, list(init), [xs[i] for i in keep_x], tuple(consts[j] for j in keep_k), *node.args[4:])
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()


def in_the_graph(t: torch.Tensor) -> bool:
    """Whether `t` is a value of the graph `make_fx` records now (not one made while it recorded nothing)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, has_proxy_slot

    mode = get_proxy_mode()
    return mode is not None and has_proxy_slot(t, mode.tracer)
