"""Keep a remat'd block's recomputation where it belongs: after the gradient reaches it.

Public names: none (used by `remat.py`).

A recomputation reads only the block's saved inputs, so a compiler sees ops identical to the
forward's: a common-subexpression pass merges the two (the activations are kept after all) and a
scheduler may move the recomputation up into the forward pass. `tie_to_gradient(saved, grads)`
returns the saved inputs through a barrier that also reads the incoming gradients:
- traced for Inductor (`make_fx`): an opaque op `ember::remat_barrier` returning copies of the
  floating inputs (one block's worth at a time, freed after its backward; a DTensor's local shard);
- on XLA: torch_xla's `optimization_barrier_`, as `torch_xla.utils.checkpoint` does;
- eagerly: nothing, the backward already runs after the forward.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor

from .define_once import define_once
from .local_shards import rewrap, to_local
from .trace_context import here

__all__: List[str] = []


def _define() -> Callable[..., List[Tensor]]:
    @torch.library.custom_op("ember::remat_barrier", mutates_args=())
    def barrier(tensors: List[Tensor], after: List[Tensor]) -> List[Tensor]:
        return [t.clone() for t in tensors]

    @barrier.register_fake
    def _(tensors: List[Tensor], after: List[Tensor]) -> List[Tensor]:
        return [torch.empty_like(t) for t in tensors]

    def setup(ctx, inputs, output) -> None:  # noqa: ANN001
        ctx.n_after = len(inputs[1])

    def backward(ctx, grads):  # noqa: ANN001
        return list(grads), [None] * ctx.n_after

    barrier.register_autograd(backward, setup_context=setup)

    @barrier.register_vmap
    def _(info, in_dims, tensors, after):  # noqa: ANN001
        return [t.clone() for t in tensors], list(in_dims[0])

    return barrier


_barrier = define_once("remat_barrier", _define)


def tie_to_gradient(saved: Sequence[Tensor], grads: Sequence[Optional[Tensor]]) -> List[Tensor]:
    """`saved`, its floating tensors passed through a barrier that also reads `grads`."""
    after = [g for g in grads if isinstance(g, Tensor)]
    picked = [i for i, t in enumerate(saved) if isinstance(t, Tensor) and t.is_floating_point()]
    if not after or not picked:
        return list(saved)
    if saved[picked[0]].device.type == "xla":
        if here().in_xla_loop:  # a barrier inside a While's body crashes torch_xla 2.9's CPU compile (measured)
            return list(saved)
        import torch_xla.core.xla_model as xm

        xm.optimization_barrier_([*saved, *after])
        return list(saved)
    if here().tracer is None:
        return list(saved)
    out = list(saved)
    # DTensor has no rule for ember's op: the barrier runs on the local shards, placed back as they were
    tensors, layouts = to_local([saved[i] for i in picked])
    copies = rewrap(_barrier(tensors, to_local(after)[0]), layouts)
    for i, t in zip(picked, copies):
        out[i] = t
    return out
