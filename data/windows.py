"""Fixed-length training windows over a token stream (a grain random-access source).

Public names:
    TokenWindows: window `i` is `tokens[i * seq_len : i * seq_len + seq_len + 1]`; consecutive
        windows share one token, so every token is a target exactly once.
    split_inputs_targets: `(..., seq_len + 1)` windows -> `{"inputs", "targets"}` shifted by one.
    num_windows: how many windows a stream of `n` tokens holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .token_bin import TokenBin

__all__ = ["TokenWindows", "num_windows", "split_inputs_targets"]


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Returns `(num_tokens - 1) // seq_len`, the number of full windows of `seq_len + 1` tokens.

    Args:
        num_tokens: length of the token stream.
        seq_len: model sequence length (each window holds `seq_len + 1` tokens).

    Returns:
        The window count (0 if the stream is shorter than one window).
    """
    return max(num_tokens - 1, 0) // seq_len


def split_inputs_targets(windows: np.ndarray) -> dict[str, np.ndarray]:
    """Splits windows of `seq_len + 1` tokens into next-token inputs and targets.

    Args:
        windows: `(..., seq_len + 1)` integer array.

    Returns:
        `{"inputs": windows[..., :-1], "targets": windows[..., 1:]}`, each `(..., seq_len)` int64
        and C-contiguous (so `torch.from_numpy` shares memory with them).

    Example:
        >>> split_inputs_targets(np.arange(5))["targets"].tolist()
        [1, 2, 3, 4]
    """
    w = np.asarray(windows)
    return {
        "inputs": np.ascontiguousarray(w[..., :-1], dtype=np.int64),
        "targets": np.ascontiguousarray(w[..., 1:], dtype=np.int64),
    }


class TokenWindows:
    """Random access to the fixed-length windows of a token stream.

    Follows grain's `RandomAccessDataSource` protocol (`len`, `__getitem__`), so
    `grain.MapDataset.source(TokenWindows(tokens, seq_len=256))` works, and `gather` reads a
    whole batch of windows with one fancy index.

    Args:
        tokens: a 1-D integer array (in memory or `np.memmap`) or a `TokenBin`; a `TokenBin` is
            pickled by path, so grain workers reopen the file instead of copying the tokens.
        seq_len: model sequence length; each window holds `seq_len + 1` tokens.

    Raises:
        ValueError: if `seq_len < 1`, the tokens are not 1-D, or they do not fill one window.
        TypeError: if the tokens are not integers.

    Example:
        >>> w = TokenWindows(np.arange(10), seq_len=4)
        >>> len(w), w[1].tolist()
        (2, [4, 5, 6, 7, 8])
    """

    def __init__(self, tokens: np.ndarray | TokenBin, *, seq_len: int) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}.")
        self.tokens = tokens if isinstance(tokens, TokenBin) else np.asarray(tokens)
        arr = self.tokens.array if isinstance(tokens, TokenBin) else self.tokens
        if arr.ndim != 1:
            raise ValueError(f"tokens must be a 1-D token stream, got shape {arr.shape}; flatten it first.")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"tokens must be integer ids, got dtype {arr.dtype}.")
        self.seq_len = seq_len
        self.num_tokens = int(arr.shape[0])
        self._len = num_windows(self.num_tokens, seq_len)
        if self._len == 0:
            raise ValueError(
                f"seq_len={seq_len} needs at least {seq_len + 1} tokens for one window (inputs and "
                f"targets shifted by one), but the token stream has {self.num_tokens}; lower seq_len "
                f"or add data (e.g. a larger max_bytes)."
            )
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def _array(self) -> np.ndarray:
        return self.tokens.array if isinstance(self.tokens, TokenBin) else self.tokens

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        """Returns window `index` as a `(seq_len + 1,)` array of the stream's dtype."""
        i = int(index)
        if not -self._len <= i < self._len:
            raise IndexError(f"window index {index} out of range for {self._len} windows.")
        start = (i % self._len) * self.seq_len
        return np.asarray(self._array()[start : start + self.seq_len + 1])

    def gather(self, indices: Any) -> np.ndarray:
        """Reads several windows at once.

        Args:
            indices: `(B,)` window indices.

        Returns:
            `(B, seq_len + 1)` array of the stream's dtype.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            raise IndexError(f"window indices must be in [0, {self._len}), got {idx.min()}..{idx.max()}.")
        return np.asarray(self._array()[idx[:, None] * self.seq_len + self._offsets])  # (B, seq_len + 1)

    def __repr__(self) -> str:
        return f"TokenWindows({self._len} windows of {self.seq_len}+1 tokens from {self.num_tokens} tokens)"
