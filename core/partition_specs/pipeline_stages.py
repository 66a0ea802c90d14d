"""Where a pipeline's stages sit and how its buffer moves between them (`pipeline` and its DTensor form).

`Stages` names this process's stages and the `pp` group it exchanges with; `shift` moves the stage buffer
one stage along, `hand_out` gives the first stage's output to every process of `pp`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["LAYERS", "PP", "PipelineError", "Stages", "hand_out"]

PP = "pp"
LAYERS = "layers"  # the logical axis of the stacked layers, which the rule ("layers", "pp") splits


class PipelineError(ValueError):
    """A pipeline that cannot be scheduled as asked; the message names the fix."""


class Stages:
    """Where this process's stages sit: `first`, the global index of its first stage, `local` of them,
    the `pp` process group it exchanges with (None: one process holds every stage), and the groups of the
    batch axes that split its rows (DTensor)."""

    def __init__(self, stages: int, group: Any = None, rank: int = 0, size: int = 1,
                 pin: Callable[[Tensor], Tensor] = lambda t: t, batch_groups: Sequence[Tuple[Any, int, int]] = ()):
        self.local, self.group, self.rank, self.size, self.pin = stages // size, group, rank, size, pin
        self.first, self.batch_groups = rank * self.local, batch_groups  # (group, rank, size) of each batch axis
        self.vmap = True  # the local stages as one batch (False: one after another)

    def shift(self, out: Tensor) -> Tensor:
        """The buffer one stage along, circularly: slot s gets stage s-1's output, slot 0 the last stage's."""
        if self.group is None:
            return self.pin(torch.roll(out, 1, dims=0))
        from ..compat.functional_collectives import all_to_all_single_autograd

        last = out[-1]
        mb = last.shape[0]
        send = [mb if j == (self.rank + 1) % self.size else 0 for j in range(self.size)]
        recv = [mb if j == (self.rank - 1) % self.size else 0 for j in range(self.size)]
        came = all_to_all_single_autograd(last.contiguous(), recv, send, self.group)
        return torch.cat([came.unsqueeze(0), out[:-1]])


def hand_out(result: Tensor, place: Stages) -> Tensor:
    """The first process's `result` on every process of `pp`. The output is replicated, so each process's
    loss sees the whole gradient: it flows to the first process's `result` alone (the others' did not
    count), through a term that adds zero."""
    if place.group is None:
        return result
    from ..compat.functional_collectives import broadcast, wait_tensor

    # the root is a rank of the group (the functional op hands it to ProcessGroup.broadcast as its root)
    sent = wait_tensor(broadcast(result.detach().contiguous(), 0, place.group))
    return sent + (result - result.detach()) * float(place.rank == 0)
