"""Dropless experts as sorted pairs and a grouped GEMM: tokens -> rows sorted by expert -> tokens.

Public names: `SortedPairs`, `sort_pairs`, `grouped_experts`, `grouped_swiglu`, `grouped_experts_on_shards`,
`grouped_slots`, `grouped_slots_on_shards`.

Every (token, choice) pair becomes one row; a stable sort orders the rows by expert, and each expert's
rows are padded to `align` rows (the kernel's alignment: 1 on the CPU). The experts then run as three
grouped matmuls over their own rows only, where the padded dispatch (`moe_dispatch.py`) gives every
expert a slot per token. Shapes depend on the config only (`N * k + E * (align - 1)` rows), so one
compiled graph serves every routing and nothing is read back to the host. Padding tokens sort past the
last expert: they take no row of compute and count for no expert.

On a DTensor mesh without `ep` (`grouped_experts_on_shards`) each process sorts and computes the
tokens it holds: with the expert weights whole (data parallelism, FSDP after its gather) its output
is its tokens' shard, and with them split by `"mlp"` over `tp` (tokens whole there) it is a partial
sum that the next layer reduces, as a tensor-parallel SwiGLU's is.

Under `ep` the tokens still travel in the padded buffer of the all-to-all (`moe_dispatch.py`); each
process then computes only the filled slots of the experts it holds (`grouped_slots_on_shards`): the
slots sorted by expert, empty ones last, and the same three grouped matmuls.

Example:
    >>> import torch
    >>> p = sort_pairs(torch.tensor([[1], [0], [1]]), n_experts=2)  # (N=3, k=1)
    >>> p.source.tolist(), p.ends.tolist(), p.row.tolist()        # rows: token 1, then tokens 0 and 2
    ([1, 0, 2], [1, 3], [[1], [0], [2]])
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.compat.grouped_mm import grouped_mm
from ...core.remat_policies import checkpoint_name
from ...core.types import Params

__all__ = ["SortedPairs", "grouped_experts", "grouped_experts_on_shards", "grouped_slots", "grouped_slots_on_shards",
           "grouped_swiglu", "sort_pairs"]


class SortedPairs(NamedTuple):
    """Where each (token, expert) pair's row is.

    Attributes:
        source: (R,) int64, row -> its token, or `N` (a row of zeros: alignment or unused).
        row: (N, k) int64, token t's j-th choice -> its row, or `R` (padding: no row).
        ends: (E,) int32, the row after expert e's last.
        counts: (E,) float32, pairs of real tokens routed to each expert.
    """

    source: Tensor
    row: Tensor
    ends: Tensor
    counts: Tensor


def sort_pairs(indices: Tensor, n_experts: int, valid: Optional[Tensor] = None, align: int = 1) -> SortedPairs:
    """Rows for routed pairs, grouped by expert.

    Args:
        indices: (N, k) chosen experts.
        valid: (N,) bool, False for padding; None: every token is real.
        align: each expert's rows are padded to a multiple of this.
    """
    N, k = indices.shape
    E, P = n_experts, N * k
    R = P + E * (align - 1)
    device = indices.device
    expert = indices.reshape(P)  # pair t*k + j: token t's j-th choice
    if valid is not None:
        expert = torch.where(valid.reshape(N).repeat_interleave(k), expert, torch.full_like(expert, E))
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add(0, expert, torch.ones_like(expert))
    rows = (counts[:E] + align - 1) // align * align
    starts = torch.cat([rows.cumsum(0) - rows, torch.full((1,), R, dtype=torch.int64, device=device)])  # (E+1,)
    order = torch.argsort(expert, stable=True)  # sorted position -> pair
    first = counts.cumsum(0) - counts  # (E+1,): the sorted position of each expert's first pair
    by_expert = expert[order]
    rank = torch.arange(P, device=device) - first[by_expert]
    row_sorted = torch.where(by_expert < E, starts[by_expert] + rank, torch.full_like(rank, R))
    row = torch.empty_like(order).scatter(0, order, row_sorted)  # pair -> row
    token = torch.arange(N, device=device).repeat_interleave(k)
    source = torch.full((R + 1,), N, dtype=torch.int64, device=device).scatter(0, row, token)[:R]
    return SortedPairs(source, row.view(N, k), rows.cumsum(0).to(torch.int32), counts[:E].to(torch.float32))


def grouped_experts(params: Params, x: Tensor, pairs: SortedPairs, weights: Tensor) -> Tensor:
    """Every expert's SwiGLU on its rows, weighted and summed back per token.

    Args:
        params: the layer's `gate`, `up` (E, I, d) and `down` (E, d, I).
        x: (N, d) tokens.
        pairs: from `sort_pairs`.
        weights: (N, k) routing weights.

    Returns:
        (N, d).
    """
    N, d = x.shape
    zero_row = x.new_zeros(1, d)
    rows = torch.cat([x, zero_row])[pairs.source]  # (R, d)
    out = grouped_swiglu(params, rows, pairs.ends)  # (R, d); rows past ends[-1] undefined
    per_pair = torch.cat([out, zero_row.to(out.dtype)])[pairs.row]  # (N, k, d); padding reads the zero row
    return (per_pair * weights.unsqueeze(-1).to(per_pair.dtype)).sum(1)


def grouped_swiglu(params: Params, rows: Tensor, ends: Tensor) -> Tensor:
    """Each expert's SwiGLU on its rows: three grouped matmuls over `rows` (R, d) sorted by expert, `ends` (E,)
    the row after each expert's last. Returns (R, d); the rows from `ends[-1]` on hold no defined value."""
    gate = grouped_mm(rows, params["gate"].transpose(-2, -1), ends)  # (R, I)
    up = grouped_mm(rows, params["up"].transpose(-2, -1), ends)
    h = checkpoint_name(F.silu(gate) * up, "mlp_hidden")
    return grouped_mm(h, params["down"].transpose(-2, -1), ends)


def grouped_slots(params: Params, buffer: Tensor, counts: Tensor, align: int = 1) -> Tensor:
    """Every expert's SwiGLU on the filled slots of a padded buffer, as grouped matmuls: the slots of
    expert parallelism's exchange, computed without the empty ones.

    Args:
        params: `gate`, `up` (E, I, d) and `down` (E, d, I).
        buffer: (G, E, C, d); slot c of (g, e) is filled when c < counts[g, e].
        counts: (G, E) pairs routed to each expert and group.
        align: the kernel's row alignment.

    Returns:
        (G, E, C, d), zeros in the empty slots.
    """
    G, E, C, d = buffer.shape
    rows = buffer.transpose(0, 1).reshape(E * G * C, d)  # expert-major: each expert's slots of every group
    expert = torch.arange(E, device=buffer.device).repeat_interleave(G * C)
    slot = torch.arange(C, device=buffer.device)
    filled = (slot < counts.t().reshape(E * G, 1)).reshape(E * G * C)
    pairs = sort_pairs(expert[:, None], E, filled, align)
    y = grouped_experts(params, rows, pairs, torch.ones(E * G * C, 1, dtype=rows.dtype, device=rows.device))
    return y.view(E, G, C, d).transpose(0, 1)


def _local_plan(x: Any, routed: List[Any], experts: List[Any], expert_dim: Optional[int]) -> Optional[Tuple]:
    """How each mesh dimension of the DTensor `x` (tokens, or a buffer whose `expert_dim` splits by expert)
    maps to a local computation: `(out, grad_x, grad_w, counts)` placements (grad_w None: the weight's own);
    None where the layout does not allow one."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    mlp_dims = (1, 1, 2)  # where "mlp" is in gate, up (E, I, d) and down (E, d, I)
    out, grad_x, grad_w, counts = [], [], [], []
    for dim, here in enumerate(x.placements):
        held = [w.placements[dim] for w in experts]
        if any(t.placements[dim] != here for t in routed):
            return None
        if here in (Replicate(), Shard(0)) and all(p == Replicate() for p in held):  # whole weights
            plan = (here, here, Partial() if here == Shard(0) else Replicate(), Partial() if here == Shard(0)
                    else Replicate())
        elif here == Replicate() and all(p == Shard(m) for p, m in zip(held, mlp_dims)):  # tensor parallel
            plan = (Partial(), Partial(), None, Replicate())
        elif expert_dim is not None and here == Shard(expert_dim) and all(p == Shard(0) for p in held):  # ep
            plan = (here, here, None, Shard(0))
        else:
            return None
        for placements, p in zip((out, grad_x, grad_w, counts), plan):
            placements.append(p)
    return out, grad_x, grad_w, counts


def _local_weights(params: Params, grad_w: List[Any]) -> Dict[str, Tensor]:
    return {name: params[name].to_local(grad_placements=[h if g is None else g
                                                          for g, h in zip(grad_w, params[name].placements)])
            for name in ("gate", "up", "down")}


def grouped_experts_on_shards(params: Params, x: Tensor, indices: Tensor, weights: Tensor, valid: Optional[Tensor],
                              n_experts: int, align: int) -> Optional[Tuple[Tensor, Tensor]]:
    """`grouped_experts` of DTensors, each process on the tokens it holds; None where the layout does not
    allow it (a mesh dimension splitting the tokens other than by batch, the experts, or the weights
    other than by `"mlp"` with the tokens whole).

    Args:
        params: `gate`, `up`, `down` as the compute rules lay them out.
        x: (N, d) tokens; `indices`, `weights`: (N, k); `valid`: (N,) or None; laid out as `x`.

    Returns:
        `(y (N, d), counts (E,))`: the output and the routed pairs of real tokens per expert.
    """
    from torch.distributed.tensor import DTensor

    experts = [params["gate"], params["up"], params["down"]]
    routed = [indices, weights] + ([] if valid is None else [valid])  # laid out as the tokens
    if not all(isinstance(t, DTensor) for t in [x, *routed, *experts]):
        return None
    plan = _local_plan(x, routed, experts, expert_dim=None)
    if plan is None:
        return None
    out, grad_x, grad_w, counts = plan
    pairs = sort_pairs(indices.to_local(), n_experts, None if valid is None else valid.to_local(), align)
    y = grouped_experts(_local_weights(params, grad_w), x.to_local(grad_placements=grad_x), pairs,
                        weights.to_local(grad_placements=grad_x))
    return (DTensor.from_local(y, x.device_mesh, out, run_check=False),
            DTensor.from_local(pairs.counts, x.device_mesh, counts, run_check=False))


def grouped_slots_on_shards(params: Params, buffer: Tensor, counts: Tensor, align: int) -> Optional[Tensor]:
    """`grouped_slots` of DTensors: each process computes the filled slots of the experts it holds (the
    buffer split by expert over `ep`, by group over the other batch axes). None where the layout does
    not allow it.

    Args:
        params: `gate`, `up`, `down` as the compute rules lay them out.
        buffer: (G, E, C, d); `counts`: (G, E), laid out as the buffer's first two dimensions.
    """
    from torch.distributed.tensor import DTensor

    experts = [params["gate"], params["up"], params["down"]]
    if not all(isinstance(t, DTensor) for t in [buffer, counts, *experts]):
        return None
    plan = _local_plan(buffer, [counts], experts, expert_dim=1)
    if plan is None:
        return None
    out, grad_x, grad_w, _ = plan
    y = grouped_slots(_local_weights(params, grad_w), buffer.to_local(grad_placements=grad_x), counts.to_local(),
                      align)
    return DTensor.from_local(y, buffer.device_mesh, out, run_check=False)
