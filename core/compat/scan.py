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
tensor that shares its storage with an earlier one is copied. After the trace, `constants_as_factories`
makes a body's 0-d literals with `full`, `hoist_invariants` computes before each loop what its body computes
from its constant inputs alone, and `drop_unread_inputs` takes out of each loop the inputs its body no longer
reads (the node's arguments are the op's private layout).
"""

from __future__ import annotations

import operator
from typing import Callable, List, Sequence, Tuple

import torch

__all__ = ["constants_as_factories", "drop_unread_inputs", "hoist_invariants", "in_the_graph", "torch_scan"]

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


def _loops(gm: torch.fx.GraphModule) -> List[Tuple[torch.fx.Node, torch.fx.GraphModule]]:
    """Each `scan` node of `gm`, with its body."""
    from torch._higher_order_ops.scan import scan_op

    return [(node, getattr(gm, node.args[0].target)) for node in gm.graph.nodes
            if node.op == "call_function" and node.target is scan_op]


def drop_unread_inputs(gm: torch.fx.GraphModule) -> None:
    """Take out of each `scan` node of `gm` the sliced and constant inputs its body does not read, as JAX's scan
    drops dead inputs: a stack of layers that draws nothing still gets its per-layer keys, and the loop would
    keep them, and the graph that makes them, alive. A loop keeps one sliced input (its length)."""
    changed = False
    for node, body in _loops(gm):
        body_attr, init, xs, consts = node.args[:4]
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


_NOT_HOISTED = ("_c10d_functional", "c10d_functional", "_dtensor", "ember")  # collectives move bytes; ember's barrier


def _pure(node: torch.fx.Node) -> bool:
    """Whether `node` computes the same value from the same inputs, writes nothing and moves no bytes between
    processes: an ATen op without mutation or a random seed, or an item of one's results."""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    return target.namespace not in _NOT_HOISTED and torch.Tag.nondeterministic_seeded not in target.tags


def _fresh_value(node: torch.fx.Node, budget: int) -> bool:
    """Whether `node` may leave its loop: a new tensor (no view of an input), not 0-d, at most `budget` bytes."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.numel() * val.element_size() > budget:
        return False
    made_by = node.args[0] if node.target is operator.getitem else node  # an item: of the op's results
    target = made_by.target
    return not (isinstance(target, torch._ops.OpOverload)
                and (target.is_view or target.__name__.split(".")[0] == "_unsafe_view"))


def hoist_invariants(gm: torch.fx.GraphModule) -> None:
    """Compute once, before each `scan` node of `gm`, what its body computes from its constant inputs alone, as
    XLA's while-loop invariant code motion does: a rotary table made inside every layer from `arange` is made
    once and read by each step. A value leaves the loop where a step reads it: a new tensor, no bigger than the
    carry's tensors together (the loop holds it throughout), not a step's output (which may not be an input)."""
    changed = False
    for node, body in _loops(gm):
        body_attr, init, xs, consts = node.args[:4]
        hoist_invariants(body)  # loops inside the body first: what they hoist may leave this loop too
        places = [n for n in body.graph.nodes if n.op == "placeholder"]
        n_c, n_x = len(init), len(xs)
        if any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable for n in body.graph.nodes):
            continue  # a body that writes a tensor: a value it writes must be made in each step
        invariant = set(places[n_c + n_x:])
        for n in body.graph.nodes:
            if n.op == "call_function" and _pure(n) and all(a in invariant for a in n.all_input_nodes):
                invariant.add(n)
        budget = sum(p.meta["val"].numel() * p.meta["val"].element_size() for p in places[:n_c]
                     if isinstance(p.meta.get("val"), torch.Tensor))
        stays = {n for n in body.graph.nodes if n not in invariant}  # computed in each step
        while True:  # the invariants a step reads; one that may not leave stays, and its inputs are read instead
            read = [n for n in body.graph.nodes if n in invariant and n.op != "placeholder" and n not in stays
                    and any(u in stays for u in n.users)]
            held = [n for n in read if not _fresh_value(n, budget) or body.graph.output_node() in n.users]
            if not held:
                break
            stays.update(held)
        if not read:
            continue
        outside = dict(zip(places[n_c + n_x:], consts))
        with gm.graph.inserting_before(node):
            for n in body.graph.nodes:  # every invariant, in order (what the read ones do not need is dropped)
                if n in invariant and n not in outside:
                    outside[n] = gm.graph.node_copy(n, lambda a: outside[a])
        last = places[-1]
        for n in read:
            with body.graph.inserting_after(last):
                last = body.graph.placeholder(f"hoisted_{n.name}")
            last.meta = dict(n.meta)
            n.replace_all_uses_with(last)
        body.graph.eliminate_dead_code()
        body.recompile()
        node.args = (body_attr, list(init), list(xs), (*consts, *(outside[n] for n in read)), *node.args[4:])
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()


def constants_as_factories(gm: torch.fx.GraphModule) -> None:
    """Make each 0-d literal a `scan` body holds (`torch.tensor(2.0)` in a step: a constant attribute and its
    `lift_fresh_copy`) with `full` instead: AOTAutograd's functionalization before torch 2.15 refuses the
    lifted constant of a body ("Attempting to use FunctionalTensor on its own", pytorch/pytorch#185805)."""
    for node, body in _loops(gm):
        constants_as_factories(body)
        changed = False
        for lift in [n for n in body.graph.nodes if n.target is torch.ops.aten.lift_fresh_copy.default]:
            const = lift.args[0]
            value = getattr(body, const.target, None) if const.op == "get_attr" else None
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                continue
            with body.graph.inserting_before(lift):
                made = body.graph.call_function(torch.ops.aten.full.default, ([], value.item()),
                                                {"dtype": value.dtype, "device": value.device})
            made.meta = dict(lift.meta)
            lift.replace_all_uses_with(made)
            body.graph.erase_node(lift)
            changed = True
        if changed:
            body.graph.eliminate_dead_code()
            body.recompile()
