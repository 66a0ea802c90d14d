"""The grain pipeline: token stream -> windows -> shard -> shuffle -> repeat -> batch.

Public names:
    make_pipeline: one call from a corpus (documents, token array, `.bin` file) to a resumable
        iterator of `{"inputs": (B, T) int64, "targets": (B, T) int64}` numpy batches.
    window_batches: the same pipeline as a `grain.MapDataset` of batches, to compose further.
    shard_window_ids: the window ids one data-parallel shard reads (disjoint across shards).
    GatherWindows: the grain map from a batch of window ids to the batch dict.

Sharding is by data-parallel rank: shard `r` of `n` reads windows `r, r + n, r + 2n, ...` among
the first `n * (len // n)` windows, so shards never overlap and all have the same length (every
rank takes the same number of steps). Shuffling is per shard, seeded, and different every epoch.

grain surprise handled here: `MapDataset.shuffle` seeds epoch `e` with `seed + e`, so seed 1 would
replay seed 0's order shifted by one epoch. The user seed is hashed first (splitmix64).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grain
import numpy as np

from .context_order import ContextOrder
from .iterator import PipelineIterator
from .token_bin import TokenBin
from .token_stream import tokenize_documents
from .tokenizers import Tokenizer
from .windows import TokenWindows, split_inputs_targets

__all__ = ["GatherWindows", "make_pipeline", "shard_window_ids", "window_batches"]

_MASK64 = (1 << 64) - 1


def _grain_seed(seed: int) -> int:
    """splitmix64(seed) folded to grain's 32-bit seed range."""
    z = (int(seed) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % 2**32


class GatherWindows:
    """Maps a `(B,)` array of window ids to `{"inputs", "targets"}`, each `(B, seq_len)` int64.

    Args:
        windows: the `TokenWindows` to read from (pickled to grain workers: a `TokenBin` stream
            travels as its path), or windows whose `gather` returns the batch dict itself (packed SFT).
    """

    def __init__(self, windows: TokenWindows) -> None:
        self.windows = windows

    def __call__(self, ids: Any) -> dict[str, np.ndarray]:
        windows = self.windows.gather(ids)
        if isinstance(windows, dict):  # already whole examples (`ember.data.sft.PackedWindows`)
            return windows
        return split_inputs_targets(windows)  # (B, seq_len + 1) -> 2 x (B, seq_len)


def _check_shard(shard_index: int, shard_count: int) -> None:
    if not isinstance(shard_count, int) or shard_count < 1:
        raise ValueError(f"shard_count must be an int >= 1 (the data-parallel size), got {shard_count!r}.")
    if not isinstance(shard_index, int) or not 0 <= shard_index < shard_count:
        raise ValueError(
            f"shard_index must be an int in [0, shard_count={shard_count}) (this rank's data-parallel "
            f"index), got {shard_index!r}."
        )


def shard_window_ids(num_windows: int, *, shard_index: int = 0, shard_count: int = 1) -> grain.MapDataset:
    """Returns the window ids shard `shard_index` of `shard_count` reads, as a `MapDataset`.

    Shard `r` reads ids `r, r + n, r + 2n, ...` below `n * (num_windows // n)`: shards are
    disjoint, equally long, and together cover all but at most `n - 1` windows.

    Args:
        num_windows: total number of windows.
        shard_index: this data-parallel rank.
        shard_count: the data-parallel size.

    Returns:
        A `MapDataset` of `num_windows // shard_count` ints.

    Raises:
        ValueError: for a bad shard, or fewer windows than shards.

    Example:
        >>> list(shard_window_ids(7, shard_index=1, shard_count=3))
        [1, 4]
    """
    _check_shard(shard_index, shard_count)
    per_shard = num_windows // shard_count
    if per_shard == 0:
        raise ValueError(
            f"{num_windows} windows cannot feed shard_count={shard_count} shards (each needs at least "
            f"one); use more data, a smaller seq_len, or fewer data-parallel ranks."
        )
    return grain.MapDataset.range(per_shard * shard_count)[shard_index::shard_count]


def window_batches(
    windows: TokenWindows,
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    shard_index: int = 0,
    shard_count: int = 1,
    repeat: bool = True,
    drop_remainder: bool = True,
    context_parallel: int = 1,
) -> grain.MapDataset:
    """Builds the batched grain `MapDataset` over one shard of the windows.

    Args:
        windows: `TokenWindows` over the token stream.
        batch_size: windows per batch (per data-parallel rank).
        seed: shuffle seed; the order differs per epoch and per seed.
        shuffle: shuffle windows (within the shard) each epoch.
        shard_index: this data-parallel rank.
        shard_count: the data-parallel size.
        repeat: repeat forever (batches then run across epoch boundaries); otherwise one epoch.
        drop_remainder: drop a final partial batch (only matters with `repeat=False`).
        context_parallel: the mesh's `cp`; above 1 each sequence comes in its balanced order (`ContextOrder`).

    Returns:
        A `MapDataset` of `{"inputs": (B, T) int64, "targets": (B, T) int64}` dicts; infinite
        (`len == sys.maxsize`) when `repeat`.

    Raises:
        ValueError: for a bad batch size or shard, or a shard with fewer windows than a batch.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    order = ContextOrder(context_parallel, windows.seq_len)
    ids = shard_window_ids(len(windows), shard_index=shard_index, shard_count=shard_count)
    if len(ids) < batch_size and (repeat or drop_remainder):
        raise ValueError(
            f"each shard holds {len(windows)} windows // shard_count {shard_count} = {len(ids)} windows "
            f"of seq_len={windows.seq_len}, fewer than batch_size={batch_size}; lower batch_size or "
            f"seq_len, or add data."
        )
    if shuffle:
        ids = ids.shuffle(seed=_grain_seed(seed))
    if repeat:
        ids = ids.repeat()
    batches = ids.batch(batch_size, drop_remainder=drop_remainder).map(GatherWindows(windows))
    return batches if context_parallel == 1 else batches.map(order)


def _as_windows(source: Any, tokenizer: Tokenizer | None, seq_len: int) -> TokenWindows:
    if isinstance(source, TokenWindows):
        if source.seq_len != seq_len:
            raise ValueError(f"source is TokenWindows with seq_len={source.seq_len}, but seq_len={seq_len} was passed.")
        return source
    if isinstance(source, (TokenBin, np.ndarray)):
        return TokenWindows(source, seq_len=seq_len)
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        raise TypeError(
            f"source is a path ({source!r}); open it first: ember.data.load_source(path) picks "
            f"text_files / load_token_bin / hf_text_from_disk, or call one of those directly."
        )
    if isinstance(source, Iterable):
        if tokenizer is None:
            raise ValueError(
                "source holds documents (text), so a tokenizer is needed: pass tokenizer=ByteTokenizer(eos=True) "
                "or a trained BPETokenizer."
            )
        return TokenWindows(tokenize_documents(source, tokenizer), seq_len=seq_len)
    raise TypeError(
        f"source must be documents (an iterable of str), a 1-D token array, a TokenBin or TokenWindows; "
        f"got {type(source).__name__}."
    )


def make_pipeline(
    source: Any,
    *,
    tokenizer: Tokenizer | None = None,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    shard_index: int = 0,
    shard_count: int = 1,
    num_workers: int = 0,
    repeat: bool = True,
    drop_remainder: bool = True,
    read_options: grain.ReadOptions | None = None,
    context_parallel: int = 1,
) -> PipelineIterator:
    """Builds a resumable, sharded, shuffled iterator of next-token-prediction batches.

    Documents are tokenized into one stream (each followed by EOS), cut into windows of
    `seq_len + 1` tokens, sharded by data-parallel rank, shuffled per epoch and batched.

    Args:
        source: documents (`stdlib_corpus()`, `text_files(...)`, `hf_text_from_disk(...)`, a list
            of str), a 1-D token array, a `TokenBin`, or `TokenWindows`.
        tokenizer: needed for documents; ignored for tokens.
        seq_len: tokens per example (T).
        batch_size: examples per batch on this rank (B).
        seed: shuffle seed.
        shuffle: shuffle windows each epoch.
        shard_index: this data-parallel rank.
        shard_count: the data-parallel size.
        num_workers: grain worker processes (0: read in this process). The main script must be
            guarded by `if __name__ == "__main__":` because workers re-import it.
        repeat: repeat forever; otherwise stop after one epoch.
        drop_remainder: drop a final partial batch when `repeat=False`.
        read_options: grain `ReadOptions` (default: 2 threads, 4 batches buffered).
        context_parallel: the mesh's `cp` (`ContextOrder`; the batches then carry `positions`).

    Returns:
        A `PipelineIterator` yielding `{"inputs": (B, T) int64, "targets": (B, T) int64}` numpy
        dicts, with `get_state()` / `set_state()` for checkpoints.

    Raises:
        ValueError: if the data is shorter than one window, a shard is smaller than a batch, or an
            argument is out of range.
        TypeError: for an unsupported source.

    Example:
        >>> from ember.data import ByteTokenizer, stdlib_corpus
        >>> it = make_pipeline(stdlib_corpus(max_bytes=50_000), tokenizer=ByteTokenizer(eos=True),
        ...                    seq_len=32, batch_size=4, seed=0)
        >>> batch = next(it)
        >>> batch["inputs"].shape, batch["targets"].dtype
        ((4, 32), dtype('int64'))
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}.")
    windows = _as_windows(source, tokenizer, seq_len)
    dataset = window_batches(
        windows,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        shard_index=shard_index,
        shard_count=shard_count,
        repeat=repeat,
        drop_remainder=drop_remainder,
        context_parallel=context_parallel,
    )
    config = {
        "num_tokens": windows.num_tokens,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "seed": int(seed),
        "shuffle": bool(shuffle),
        "shard_index": shard_index,
        "shard_count": shard_count,
        "repeat": bool(repeat),
        "drop_remainder": bool(drop_remainder),
    }
    per_shard = len(windows) // shard_count
    return PipelineIterator(
        dataset,
        config=config,
        num_workers=num_workers,
        read_options=read_options,
        batches_per_epoch=per_shard / batch_size,
    )
