"""Dropless experts as sorted pairs and a grouped GEMM: tokens -> rows sorted by expert -> tokens.

Public names: `SortedPairs`, `sort_pairs`, `grouped_experts`.

Every (token, choice) pair becomes one row; a stable sort orders the rows by expert, and each expert's
rows are padded to `align` rows (the kernel's alignment: 1 on the CPU). The experts then run as three
grouped matmuls over their own rows only, where the padded dispatch (`moe_dispatch.py`) gives every
expert a slot per token. Shapes depend on the config only (`N * k + E * (align - 1)` rows), so one
compiled graph serves every routing and nothing is read back to the host. Padding tokens sort past the
last expert: they take no row of compute and count for no expert.

Example:
    >>> import torch
    >>> p = sort_pairs(torch.tensor([[1], [0], [1]]), n_experts=2)  # (N=3, k=1)
    >>> p.source.tolist(), p.ends.tolist(), p.row.tolist()        # rows: token 1, then tokens 0 and 2
    ([1, 0, 2], [1, 3], [[1], [0], [2]])
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.compat.grouped_mm import grouped_mm
from ...core.remat_policies import checkpoint_name
from ...core.types import Params

__all__ = ["SortedPairs", "grouped_experts", "sort_pairs"]


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
    gate = grouped_mm(rows, params["gate"].transpose(-2, -1), pairs.ends)  # (R, I)
    up = grouped_mm(rows, params["up"].transpose(-2, -1), pairs.ends)
    h = checkpoint_name(F.silu(gate) * up, "mlp_hidden")
    out = grouped_mm(h, params["down"].transpose(-2, -1), pairs.ends)  # (R, d); rows past ends[-1] undefined
    per_pair = torch.cat([out, zero_row.to(out.dtype)])[pairs.row]  # (N, k, d); padding reads the zero row
    return (per_pair * weights.unsqueeze(-1).to(per_pair.dtype)).sum(1)
