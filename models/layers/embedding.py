"""`Embedding`: a lookup table, with `attend` for tied output projections.

Public names: `Embedding`.

The table is `(num_embeddings, features)`, the layout of `torch.nn.Embedding` and of Hugging Face
checkpoints. `attend(params, x)` multiplies by the transposed table, which is how GPT-2 and
small Llama-3 models tie their unembedding to the token embedding (Press & Wolf 2017).

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
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

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
    """

    num_embeddings: int
    features: int
    vocab_axis: Optional[str] = "vocab"
    embed_axis: Optional[str] = "embed"
    weight_init: inits.Initializer = inits.normal(1.0)
    dtype: torch.dtype = torch.float32

    def validate(self) -> None:
        for name in ("num_embeddings", "features"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"Embedding.{name} must be a positive int, got {v!r}.")

    def declare(self):
        return {
            "weight": Param(
                (self.num_embeddings, self.features),
                init=self.weight_init,
                axes=(self.vocab_axis, self.embed_axis),
                dtype=self.dtype,
            )
        }

    def apply(self, params: Params, ids: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: ids: (...) integer. Returns: (..., features) in the table's dtype."""
        return F.embedding(ids, params["weight"])

    def attend(self, params: Params, x: Tensor) -> Tensor:
        """Scores against every row: `x @ weight.T`. Args: x: (..., features). Returns: (..., num_embeddings)."""
        return F.linear(x, self.gathered(params)["weight"])
