"""Input checks shared by the model families (shapes and dtypes only: safe under tracing)."""

from __future__ import annotations

import torch
from torch import Tensor

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def check_tokens(tokens: Tensor, *, max_seq_len: int, field: str) -> None:
    """Raise unless `tokens` is a (B, T) integer tensor with T <= max_seq_len.

    Args:
        tokens: the model input.
        max_seq_len: the configured limit.
        field: the config field holding the limit, e.g. "Llama3Config.max_seq_len".
    """
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokens must be a (B, T) integer tensor, got {type(tokens).__name__}.")
    if tokens.dtype not in _INT_DTYPES:
        raise TypeError(
            f"tokens must be integer token ids (int64 or int32), got dtype {tokens.dtype}. "
            f"Convert with tokens.long()."
        )
    if tokens.dim() != 2:
        raise ValueError(
            f"tokens must have shape (B, T), got {tuple(tokens.shape)}. Add a batch dimension with "
            f"tokens[None] for a single sequence."
        )
    if tokens.shape[1] > max_seq_len:
        raise ValueError(
            f"sequence length {tokens.shape[1]} exceeds {field}={max_seq_len}. Shorten the inputs "
            f"or build the model with a larger max_seq_len (e.g. .replace(max_seq_len="
            f"{tokens.shape[1]}) on the config)."
        )
