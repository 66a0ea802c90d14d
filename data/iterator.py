"""A resumable iterator over a grain `MapDataset` of batches, with optional worker processes.

Public names:
    PipelineIterator: iterates a batched `grain.MapDataset`; `get_state()` is a small JSON dict
        (`{"next_batch": k, "config": {...}}`) and `set_state` resumes exactly, with any number of
        worker processes.
    ensure_absl_flags_parsed: marks absl flags parsed so grain's worker processes can start.

Why not grain's own iterator state: grain's state layout depends on the worker count
(`mp_prefetch` stores one state per worker), so a run could not resume with a different
`num_workers`. Every stage before batching here is a random-access `MapDataset`, so "k batches
consumed" is a complete state: resuming slices the dataset at `k` and starts fresh workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grain

__all__ = ["PipelineIterator", "ensure_absl_flags_parsed"]

_MSG_STATE = (
    "state must be the dict returned by PipelineIterator.get_state(), e.g. "
    "{'next_batch': 12, 'config': {...}}"
)


def ensure_absl_flags_parsed() -> None:
    """Marks absl flags as parsed if nobody parsed them.

    grain reads absl flags in its prefetch threads and worker processes; in a program that does
    not run `absl.app.run`, that raises `UnparsedFlagAccessError`. Parsing nothing keeps every
    flag at its default.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class PipelineIterator:
    """Iterates a batched grain `MapDataset`, resumable from `get_state()`.

    Args:
        dataset: a `grain.MapDataset` whose elements are batches (random access, possibly
            infinite).
        config: a JSON-serialisable dict describing the pipeline (seq_len, seed, shard, ...);
            stored in the state and compared on `set_state`, so a state is never applied to a
            different pipeline.
        num_workers: worker processes (grain `mp_prefetch`); 0 reads in the calling process.
        read_options: grain `ReadOptions` for the in-process read threads.
        batches_per_epoch: batches in one pass over this shard, for the `epoch` property.

    Example:
        >>> it = make_pipeline(docs, tokenizer=tok, seq_len=64, batch_size=8)  # doctest: +SKIP
        >>> batch = next(it); state = it.get_state()                          # doctest: +SKIP
    """

    def __init__(
        self,
        dataset: grain.MapDataset,
        *,
        config: Mapping[str, Any],
        num_workers: int = 0,
        read_options: grain.ReadOptions | None = None,
        batches_per_epoch: float | None = None,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}.")
        self.dataset = dataset
        self.config = dict(config)
        self.num_workers = num_workers
        self.read_options = read_options or grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
        self.batches_per_epoch = batches_per_epoch
        self._next_batch = 0
        self._it: Any = None

    def _start(self) -> Any:
        ds = self.dataset[self._next_batch :] if self._next_batch else self.dataset
        ids = ds.to_iter_dataset(self.read_options)
        if self.num_workers > 0:
            ensure_absl_flags_parsed()
            ids = ids.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.num_workers))
        return iter(ids)

    def __iter__(self) -> PipelineIterator:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = self._start()
        batch = next(self._it)
        self._next_batch += 1
        return batch

    @property
    def epoch(self) -> float:
        """Epochs consumed so far on this shard (fractional), or nan if unknown."""
        if not self.batches_per_epoch:
            return float("nan")
        return self._next_batch / self.batches_per_epoch

    def get_state(self) -> dict[str, Any]:
        """Returns the state after the last batch handed out (JSON-serialisable).

        Returns:
            `{"next_batch": int, "config": dict}`.
        """
        return {"next_batch": self._next_batch, "config": dict(self.config)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Resumes from a state returned by `get_state` (possibly after a JSON round trip).

        Worker processes, if any, are restarted at the new position.

        Args:
            state: the saved state.

        Raises:
            TypeError: if `state` is not such a dict.
            ValueError: if it was saved by a pipeline with another config (the message lists each
                differing key with the saved and the current value).
        """
        if not isinstance(state, Mapping) or "next_batch" not in state or "config" not in state:
            raise TypeError(f"{_MSG_STATE}; got {state!r:.200}.")
        next_batch = state["next_batch"]
        if not isinstance(next_batch, int) or isinstance(next_batch, bool) or next_batch < 0:
            raise ValueError(f"state['next_batch'] must be an int >= 0, got {next_batch!r}.")
        saved = dict(state["config"])
        diffs = [
            f"{k}: saved {saved.get(k, '<missing>')!r}, now {self.config.get(k, '<missing>')!r}"
            for k in sorted(set(saved) | set(self.config))
            if saved.get(k, "<missing>") != self.config.get(k, "<missing>")
        ]
        if diffs:
            raise ValueError(
                "the data state was saved by a different pipeline; differing settings: "
                + "; ".join(diffs)
                + ". Rebuild the pipeline with the saved settings to resume exactly."
            )
        self.close()
        self._next_batch = next_batch

    def close(self) -> None:
        """Stops worker processes and read threads; iteration restarts lazily if resumed."""
        it, self._it = self._it, None
        close = getattr(it, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> PipelineIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PipelineIterator(next_batch={self._next_batch}, num_workers={self.num_workers}, config={self.config})"
