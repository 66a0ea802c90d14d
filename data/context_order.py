"""`ContextOrder`: each sequence of a batch in the order that balances context parallelism's causal work.

Public names: `ContextOrder`.

Under the mesh axis `cp` each process holds a contiguous `T / cp` of every sequence. With causal
attention the last process's queries read every key and the first's only its own, so the pipeline
reorders each sequence once (`ember.core.partition_specs.context_parallel.head_tail_order`): cut into `2 cp` chunks,
process `r` holds chunks `r` and `2 cp - 1 - r`. Every `(B, T)` array moves alike (inputs, targets,
segment ids, positions), and two go along: `token_index`, each token's index before the move, which
causal masks and windows compare, and `positions` (the same, unless the batch carries its own), which
rotary embeddings read. A model gives the same result on the reordered batch as on the original, on
one device or many. The map is a pure function of the batch: the grain iterator resumes exactly as
without it.

Example:
    >>> import numpy as np
    >>> batch = {"inputs": np.arange(8)[None], "targets": np.arange(1, 9)[None]}
    >>> ContextOrder(2)(batch)["inputs"].tolist(), ContextOrder(2)(batch)["token_index"].tolist()
    ([[0, 1, 6, 7, 2, 3, 4, 5]], [[0, 1, 6, 7, 2, 3, 4, 5]])
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from ..core.partition_specs.context_parallel import head_tail_order

__all__ = ["ContextOrder"]


class ContextOrder:
    """The grain map from a batch of `(B, T)` arrays to the same batch in `cp`'s head-tail order.

    Args:
        cp: the context-parallel degree (1: the batch as it is).
        seq_len: T, checked now when given (a multiple of `2 cp`), so a bad length fails before a batch is read.
    """

    def __init__(self, cp: int, seq_len: int | None = None) -> None:
        self.cp = int(cp)
        if seq_len is not None:
            head_tail_order(seq_len, self.cp)  # raises, naming the fix

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        if self.cp == 1:
            return batch
        b, t = batch["inputs"].shape[:2]
        order = np.asarray(head_tail_order(t, self.cp))
        index = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t))
        out = {**batch, "token_index": index}
        out.setdefault("positions", index)
        return {k: v[:, order] if getattr(v, "ndim", 0) >= 2 and v.shape[:2] == (b, t) else v for k, v in out.items()}

    def __repr__(self) -> str:
        return f"ContextOrder(cp={self.cp})"
