"""torch's `scan` operator, traced with static sizes.

`torch_scan` is torch's loop operator (`torch._higher_order_ops.scan`, private since it came,
pytorch/pytorch#135603 and its stack). Called outside Dynamo it traces its body with Dynamo and records
one `scan` node whose body is a subgraph; Inductor lowers it to a loop that writes each step's outputs
into buffers preallocated for every step. A body Dynamo cannot capture whole (a Python side effect, a
graph break) raises `BodyNotTraceable`: the caller runs the Python loop instead.

torch's `scan` compiles its body with `torch.compile(fullgraph=True)` on one code object for every loop of
the process, so Dynamo's automatic dynamic shapes would make a later loop's sizes symbols (a loop of another
length recompiles it), lifted into the node's inputs as Python numbers that Inductor's `while_loop`
lowering reads as graph nodes (`'int' object has no attribute 'meta'`, pytorch/pytorch#166525).
`torch_scan` keeps sizes static, as ember's whole-step trace is.
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

__all__ = ["BodyNotTraceable", "torch_scan"]


class BodyNotTraceable(RuntimeError):
    """torch's `scan` could not trace the body whole (Dynamo's reason in the message)."""


def torch_scan(step: Callable[[List[torch.Tensor], List[torch.Tensor]], Tuple[List[torch.Tensor], List[torch.Tensor]]],
               init: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], *, reverse: bool
               ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """`step(carry, x) -> (carry, ys)` over dim 0 of `xs` (flat lists; `xs` not empty): torch's operator,
    one node of a traced graph. `ys[i]` comes from `xs[i]`, also with `reverse`."""
    from torch._dynamo.exc import Unsupported, UncapturedHigherOrderOpError
    from torch._higher_order_ops.scan import scan

    try:  # static sizes: Dynamo's automatic dynamic shapes would lift them as symbols once a second shape came
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            carry, ys = scan(step, list(init), list(xs), reverse=reverse)
    except (Unsupported, UncapturedHigherOrderOpError) as err:  # a Python side effect, a graph break
        raise BodyNotTraceable(str(err).strip().splitlines()[0] + " " + _first_line(err, "Explanation:")) from err
    return list(carry), list(ys)


def _first_line(err: Exception, prefix: str) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip().startswith(prefix)]
    return lines[0] if lines else ""
