"""`trace_and_compile`: the traced path's heart, `make_fx` on fake tensors, then a compiler (Inductor).

One fake mode, with a shape environment, serves tracing and compiling: torch's `scan` and checkpoint
operators trace their bodies in the caller's fake mode, and Inductor resolves their sizes in the same
environment; with it, Inductor's FX-graph and AOTAutograd caches can key the graph (a second process
loads it). Compiling gets a tracing context of its own: on torch 2.9, lowering `invoke_subgraph` in
the tracing context that traced it reuses the undecomposed body ("both a fallback and a decomp").
The private names it needs are reached through `core/compat/inductor.py`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..compat.inductor import compiling_in, data_dependent_errors, fake_mode, trace_fx
from ..compat.scan import constants_as_factories, drop_unread_inputs, hoist_invariants
from ..trace_context import ember_trace

__all__ = ["DataDependentError", "trace_and_compile"]


class DataDependentError(RuntimeError):
    """The traced function read a tensor's value; `str(err)` is the first line of torch's reason."""


def trace_and_compile(fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
                      compile: Optional[Callable[[torch.fx.GraphModule, Sequence[torch.Tensor]], Any]] = None) -> Any:
    """`make_fx(fn)(*inputs)` on fake tensors, then `compile(gm, inputs)` (or `gm` when None).

    While it traces, `torch.compiler.is_compiling()` is True and `trace_context.here().tracer` is "ember".

    Raises:
        DataDependentError: `fn` read a tensor's value (`.item()`, `bool(t)`, `if t > 0`).
    """
    mode = fake_mode()
    try:
        with ember_trace():
            gm = trace_fx(fn, inputs, mode)
    except data_dependent_errors() as err:
        raise DataDependentError(str(err).splitlines()[0][:200]) from err
    _drop_constant_numbers(gm)
    constants_as_factories(gm)
    hoist_invariants(gm)
    drop_unread_inputs(gm)  # after: an input read only by what left the loop leaves it too
    if compile is None:
        return gm
    with compiling_in(mode):
        # Real example inputs would be made fake again by AOTAutograd with a symbol per dimension (the mode has
        # a shape environment): the graph compiled dynamic-shaped, 12% slower steps, and torch's scan lowering
        # fails on its unbound length. Fakes of this mode with static shapes keep the graph static.
        inputs = [mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t for t in inputs]
        return compile(gm, inputs)


def _drop_constant_numbers(gm: torch.fx.GraphModule) -> None:
    """Tensors made from literals alone (an `arange` of a size) may be read as numbers while tracing: DTensor's
    redistribution planner does so for a sequence folded into a matmul's rows. Those numbers are constants, baked
    into the ops that use them, so the nodes that computed them are dropped. A number read from anything else
    (an input, a tensor the function captured) would be baked in too, silently: that is refused.

    Raises:
        DataDependentError: a tensor other than a literal's was converted to a Python number.
    """
    numbers = [n for n in gm.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]
    if not numbers:
        return
    made = set()  # the nodes the numbers came from
    todo = list(numbers)
    while todo:
        node = todo.pop()
        if node in made:
            continue
        if node.op in ("placeholder", "get_attr"):
            raise DataDependentError("a tensor was converted to a Python number")
        made.add(node)
        todo.extend(node.all_input_nodes)
    for node in reversed(list(gm.graph.nodes)):
        if node in made and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
