"""torch's `scan` operator, and the Python numbers its traced graph hands Inductor.

`torch_scan` is torch's loop operator (`torch._higher_order_ops.scan`, private since it came,
pytorch/pytorch#135603 and its stack). Called outside Dynamo it traces its body with Dynamo and records
one `scan` node whose body is a subgraph; Inductor lowers it to a loop that writes each step's outputs
into buffers preallocated for every step. A body Dynamo cannot capture whole (a Python side effect, a
graph break) raises `BodyNotTraceable`: the caller runs the Python loop instead.

Tracing a body that differentiates (`torch.func.vjp` inside it) lifts Python numbers (sizes) into the
node's additional inputs, and Inductor's lowering (a `while_loop`) reads every input as a graph node:
`'int' object has no attribute 'meta'` (pytorch/pytorch#166525, open; measured on 2.9 and 2.15, 2.13
fails in its fake-tensor updater instead). `inline_number_inputs` makes each such number a constant of
the body before Inductor sees the graph.
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

__all__ = ["BodyNotTraceable", "inline_number_inputs", "torch_scan"]


class BodyNotTraceable(RuntimeError):
    """torch's `scan` could not trace the body whole (Dynamo's reason in the message)."""


def torch_scan(step: Callable[[List[torch.Tensor], List[torch.Tensor]], Tuple[List[torch.Tensor], List[torch.Tensor]]],
               init: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], *, reverse: bool
               ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """`step(carry, x) -> (carry, ys)` over dim 0 of `xs` (flat lists; `xs` not empty): torch's operator,
    one node of a traced graph. `ys[i]` comes from `xs[i]`, also with `reverse`."""
    from torch._dynamo.exc import Unsupported, UncapturedHigherOrderOpError
    from torch._higher_order_ops.scan import scan

    try:
        carry, ys = scan(step, list(init), list(xs), reverse=reverse)
    except (Unsupported, UncapturedHigherOrderOpError) as err:  # a Python side effect, a graph break
        raise BodyNotTraceable(str(err).strip().splitlines()[0] + " " + _first_line(err, "Explanation:")) from err
    return list(carry), list(ys)


def _first_line(err: Exception, prefix: str) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip().startswith(prefix)]
    return lines[0] if lines else ""


def _scan_op() -> object:
    from torch._higher_order_ops.scan import scan_op

    return scan_op


def inline_number_inputs(gm: torch.fx.GraphModule) -> int:
    """Make the Python numbers among each `scan` node's additional inputs constants of its body graph;
    returns how many were inlined."""
    op, inlined = _scan_op(), 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not op:
            continue
        body, init, xs, extra = node.args[:4]
        numbers = [i for i, value in enumerate(extra) if isinstance(value, (bool, int, float))]
        if not numbers:
            continue
        sub = getattr(gm, body.target)
        placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
        for i in numbers:
            placeholder = placeholders[len(init) + len(xs) + i]
            placeholder.replace_all_uses_with(extra[i])
            sub.graph.erase_node(placeholder)
        sub.recompile()
        node.args = (body, init, xs, tuple(v for i, v in enumerate(extra) if i not in numbers), *node.args[4:])
        inlined += len(numbers)
    if inlined:
        gm.recompile()
    return inlined
