"""`Embedding`: a lookup table, with `attend` for tied output projections.

Public names: `Embedding`.

The table is `(num_embeddings, features)`, the layout of `torch.nn.Embedding` and of Hugging Face
checkpoints. `attend(params, x)` multiplies by the transposed table, which is how GPT-2 and
small Llama-3 models tie their unembedding to the token embedding (Press & Wolf 2017).
`padding_idx` is `torch.nn.Embedding`'s: that row starts at zero and gets no gradient from the
lookup (an output projection tied to the table still trains it), as Hugging Face builds Llama-layout
embeddings from `pad_token_id`.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Embedding
    >>> emb = Embedding(10, 4)
    >>> params = emb.init(random.key(0))
    >>> h = emb.apply(params, torch.tensor([[1, 2, 3]]))
    >>> h.shape, emb.attend(params, h).shape
    (torch.Size([1, 3, 4]), torch.Size([1, 3, 10]))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.partition_specs.context_parallel import split_rows
from ...core.types import Key, Params
from . import initializers as inits
from .module import Module
from .param import Param

__all__ = ["Embedding"]


@dataclasses.dataclass(frozen=True)
class Embedding(Module):
    """Token (or position) embedding table.

    Attributes:
        num_embeddings: number of rows (vocabulary size, or maximum position).
        features: embedding width.
        vocab_axis: logical name of the row dimension ("vocab"; None for a position table).
        embed_axis: logical name of the feature dimension ("embed").
        weight_init: initializer of the table (default N(0, 1), as `torch.nn.Embedding`).
        dtype: parameter dtype.
        padding_idx: a row that starts at zero and gets no gradient from the lookup (negative counts
            from the end), as `torch.nn.Embedding(padding_idx=...)`; None (the default) treats every row alike.
    """

    num_embeddings: int
    features: int
    vocab_axis: Optional[str] = "vocab"
    embed_axis: Optional[str] = "embed"
    weight_init: inits.Initializer = inits.normal(1.0)
    dtype: torch.dtype = torch.float32
    padding_idx: Optional[int] = None

    reads_key = False

    def validate(self) -> None:
        for name in ("num_embeddings", "features"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"Embedding.{name} must be a positive int, got {v!r}.")
        p, n = self.padding_idx, self.num_embeddings
        if p is not None and not (isinstance(p, int) and -n <= p < n):
            raise ValueError(f"Embedding.padding_idx must be None or an int in [-{n}, {n}), got {p!r}; "
                             f"it names a row of the {n}-row table.")

    @property
    def pad_row(self) -> Optional[int]:
        """`padding_idx` as a row number in [0, num_embeddings), or None."""
        return None if self.padding_idx is None else self.padding_idx % self.num_embeddings

    def declare(self):
        init = self.weight_init if self.padding_idx is None else _ZeroRow(self.weight_init, self.pad_row)
        return {
            "weight": Param(
                (self.num_embeddings, self.features),
                init=init,
                axes=(self.vocab_axis, self.embed_axis),
                dtype=self.dtype,
            )
        }

    def apply(self, params: Params, ids: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: ids: (...) integer. Returns: (..., features) in the table's dtype."""
        out = split_rows(lambda rows: F.embedding(rows, params["weight"]), ids)  # (..., features)
        if self.padding_idx is None:
            return out
        # Pad positions read their row but pass no gradient back to it: pure, and it lowers the same on
        # DTensor and XLA (F.embedding's own padding_idx would be a local row on a vocab-sharded table).
        return torch.where((ids == self.pad_row).unsqueeze(-1), out.detach(), out)  # (..., features)

    def attend(self, params: Params, x: Tensor) -> Tensor:
        """Scores against every row: `x @ weight.T`. Args: x: (..., features). Returns: (..., num_embeddings)."""
        weight = self.gathered(params)["weight"]
        return split_rows(lambda rows: F.linear(rows, weight), x)


@dataclasses.dataclass(frozen=True)
class _ZeroRow:
    """`init` with one row set to zero (what `torch.nn.Embedding` does to its `padding_idx` row)."""

    init: inits.Initializer
    row: int

    def __call__(self, key: Key, shape: Tuple[int, ...], dtype: torch.dtype) -> Tensor:
        w = self.init(key, shape, dtype)  # (num_embeddings, features)
        return w.index_fill(0, torch.tensor([self.row], device=w.device), 0.0)
