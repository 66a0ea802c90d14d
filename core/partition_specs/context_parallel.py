"""Context parallelism: attention over a sequence split across the mesh axis `cp`.

Public names: `context_attention`, `split_rows`, `head_tail_order`, `sequence_split`, `ContextParallelError`.

With the rule `("sequence", "cp")` every activation is split along the sequence, so each process holds
`T / cp` tokens of every example; only attention mixes tokens, and it needs every key. As in torchtitan
and MaxText, the queries stay split and the keys and values (with what the mask reads of them: token
indices, segment ids, padding) are all-gathered over `cp`; the keys' and values' gradients come back
reduce-scattered. `context_attention(attend, q, k, v, tokens=...)` runs `attend` on each process's
queries against every key:

* on DTensor, on plain local tensors: `attend` gets this process's `(B, H, T / cp, D)` queries, the
  gathered `(B, H, T, D)` keys and values, and each token tensor as two views, the queries' rows and
  every key's; the result is a DTensor split like the queries again;
* under torch_xla SPMD, in the one global program: the keys, values and their token tensors are
  constrained whole along the sequence (GSPMD all-gathers them), the queries and the result split;
  `split_rows` keeps the linear maps and lookups around attention split (see its docstring).

Causal attention over a split sequence is unbalanced (the last process's queries see every key, the
first's only its own), so the data pipeline reorders each sequence once, `head_tail_order`: process `r`
holds chunks `r` and `2 cp - 1 - r` of `2 cp`. Masks then come from what each token carries (its index
before the reordering, its segment), never from its place in the local shard.

Example:
    >>> head_tail_order(8, 2)
    [0, 1, 6, 7, 2, 3, 4, 5]
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..compat import refuse_where_gated
from .sharding import Sharding, constrain, current_sharding

__all__ = ["ContextParallelError", "check_dtensor_can_split_sequences", "context_attention", "head_tail_order",
           "sequence_split", "split_rows"]

ATTENTION_AXES = ("batch", "heads", "sequence", "head_dim")
"""Logical axes of queries, keys and values as attention sees them: (B, H, T, D)."""
_KEYS_AXES = ("batch", "heads", None, "head_dim")  # the keys and values whole along the sequence


class ContextParallelError(ValueError):
    """A sequence that cannot be split as asked; the message names the fix."""


def head_tail_order(seq_len: int, cp: int) -> List[int]:
    """The token order that balances causal attention over `cp` processes: the sequence cut into `2 cp`
    chunks, process `r` holding chunks `r` and `2 cp - 1 - r` (its part of the sequence, in order).

    Raises:
        ContextParallelError: `seq_len` is not a multiple of `2 cp`.
    """
    if cp < 1 or seq_len % (2 * cp):
        raise ContextParallelError(
            f"a sequence of {seq_len} tokens does not split into 2 x cp = {2 * cp} equal chunks (context parallelism "
            f"balances causal attention with two chunks per process); use a sequence length that is a multiple of "
            f"{2 * cp} (--data.seq_len) or another cp degree.")
    chunk = seq_len // (2 * cp)
    order: List[int] = []
    for r in range(cp):
        for c in (r, 2 * cp - 1 - r):
            order.extend(range(c * chunk, (c + 1) * chunk))
    return order


def check_dtensor_can_split_sequences() -> None:
    """Raise a ValueError naming the fix where this torch's DTensor cannot run a split sequence."""
    refuse_where_gated("dtensor_sequence_fold", (
        f"context parallelism on DTensor needs a torch whose DTensor folds a sequence split across processes "
        f"into a matmul's rows (torch {torch.__version__} refuses: pytorch/pytorch#166483); upgrade torch to "
        f"2.12 or newer, or run cp under torch_xla (launch/tpu_pod.py)."))


def sequence_split(sharding: Optional[Sharding] = None) -> Tuple[str, ...]:
    """The mesh axes (of size > 1) the active layout splits attention's sequence over; () when whole."""
    sharding = current_sharding() if sharding is None else sharding
    if sharding is None:
        return ()
    sizes = sharding.mesh.sizes()
    axes = sharding.compute_spec(ATTENTION_AXES).mesh_axes_of(2)
    return tuple(a for a in axes if sizes.get(a, 1) > 1)


Attend = Callable[[Tensor, Tensor, Tensor, Dict[str, Tensor], Dict[str, Tensor]], Tensor]


def context_attention(attend: Attend, q: Tensor, k: Tensor, v: Tensor, *,
                      tokens: Optional[Dict[str, Tensor]] = None) -> Tensor:
    """`attend(q, k, v, query_tokens, key_tokens)` with every key, whether or not the sequence is split.

    Args:
        attend: attention of some queries against every key: `(B, H, Tq, D)` queries, `(B, H, T, D)` keys
            and values, and the token tensors as the queries' rows `(.., Tq)` and every key's `(.., T)`;
            returns `(B, H, Tq, Dv)`.
        q, k, v: `(B, H, T, D)` (v's D may differ), laid out as the active sharding says.
        tokens: per-token tensors the mask reads, each `(B, T)` or `(T,)` (indices, segment ids, ...).

    Returns:
        `(B, H, T, Dv)`, laid out like `q`.
    """
    tokens = dict(tokens or {})
    sharding = current_sharding()
    split = sequence_split(sharding)
    if not split:
        return attend(q, k, v, tokens, tokens)
    if len(split) > 1:
        raise ContextParallelError(f"attention's sequence is split over {split}; context parallelism takes one mesh "
                                   f"axis (map 'sequence' to one axis, e.g. ('sequence', 'cp')).")
    if sharding.mesh.backend != "dtensor":  # torch_xla: one global program; GSPMD gathers what is constrained whole
        keys = {n: constrain(t, ("batch", None)[-t.dim():]) for n, t in tokens.items()}
        q, k, v = (constrain(t, ATTENTION_AXES) for t in (q, k, v))  # split as computed: GSPMD gathers k, v
        k, v = constrain(k, _KEYS_AXES), constrain(v, _KEYS_AXES)  # here, not the layer's input before them
        return constrain(attend(q, k, v, tokens, keys), ATTENTION_AXES)
    return _on_local_shards(attend, q, k, v, tokens, split[0])


def _on_local_shards(attend: Attend, q: Tensor, k: Tensor, v: Tensor, tokens: Dict[str, Tensor], axis: str) -> Tensor:
    from ..compat.functional_collectives import all_gather, all_gather_autograd
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(q, DTensor):
        raise ContextParallelError("context attention on DTensor takes DTensor queries, keys and values (split along "
                                   "the sequence); got plain tensors: place the batch with shard_batch.")
    mesh = q.device_mesh
    dim = mesh.mesh_dim_names.index(axis)
    group, rank, size = mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim)
    for name, t in (("queries", q), ("keys", k), ("values", v)):
        if not isinstance(t, DTensor) or t.placements[dim] != Shard(2):
            got = t.placements if isinstance(t, DTensor) else "a plain tensor"
            raise ContextParallelError(f"context attention: the {name} must be split along the sequence (dim 2) over "
                                       f"{axis!r}; got {got}.")
    local_len = q.shape[2] // size

    def gather(t: Tensor, dim_: int) -> Tensor:
        return all_gather(t.contiguous(), dim_, group)

    queries, keys = {}, {}
    for name, t in tokens.items():
        if isinstance(t, DTensor):
            if t.placements[dim] != Shard(t.dim() - 1):
                raise ContextParallelError(f"context attention: {name} must be split along the sequence like the "
                                           f"queries; got {t.placements}.")
            queries[name] = t.to_local()
            keys[name] = gather(queries[name], t.dim() - 1)
        elif t.dim() == 1:  # one row for every example (the default token index): slice this process's part
            queries[name], keys[name] = t[rank * local_len:(rank + 1) * local_len], t
        else:
            raise ContextParallelError(f"context attention: {name} {tuple(t.shape)} is a plain tensor with a batch "
                                       f"dimension; pass it in the batch (placed by shard_batch) or as (T,).")
    k_all = all_gather_autograd(k.to_local().contiguous(), 2, group)  # backward: reduce-scatter
    v_all = all_gather_autograd(v.to_local().contiguous(), 2, group)
    out = attend(q.to_local(), k_all, v_all, queries, keys)  # (B, H, T / cp, Dv) on this process
    shape = (*q.shape[:3], out.shape[-1])
    return DTensor.from_local(out, mesh, q.placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def split_rows(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """`fn(x)` for a row-wise `fn` of `(B, T, ...)` (a linear map, an embedding lookup), keeping a split
    sequence split.

    torch lowers a matmul of `(B, T, d)` as one of `(B * T, d)`; with `T` split over `cp` and `B` whole that
    fold cannot stay split under GSPMD, which then gathers the input. Here the rows are taken `cp`-major
    instead (`(cp, B, T / cp, ...)`, split on its first dimension), a fold GSPMD keeps split. DTensor folds
    a split sequence itself (as a strided shard) where `WORKAROUNDS["dtensor_sequence_fold"]` is off, and
    refuses it, with the fix, where it is on. Without a split sequence: `fn(x)`.
    """
    sharding = current_sharding()
    split = sequence_split(sharding) if x.dim() >= 2 else ()
    if not split:
        return fn(x)
    if sharding.mesh.backend == "dtensor":  # DTensor folds a split sequence itself, where this torch can
        check_dtensor_can_split_sequences()
        return fn(x)
    b, t, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    n = sharding.mesh.sizes()[split[0]]
    blocks = ("sequence", "batch", None, *[None] * len(rest))
    rows = constrain(x.reshape(b, n, t // n, *rest).transpose(0, 1), blocks)
    y = fn(rows.reshape(n * b * (t // n), *rest))  # (cp * B * T / cp, ...)
    out = tuple(y.shape[1:])
    y = constrain(y.reshape(n, b, t // n, *out), ("sequence", "batch", None, *[None] * len(out)))
    return y.transpose(0, 1).reshape(b, t, *out)
