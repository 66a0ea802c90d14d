"""Background-thread prefetching that keeps the iterator state of the batch handed out.

Public names:
    Prefetcher: wraps a stateful iterator; a thread reads ahead into a bounded queue (and can
        apply a transform such as a collator with device transfer there), while `get_state()`
        returns the state after the last batch *returned*, not the last batch produced.
    prefetch: `Prefetcher(iterator, buffer_size=..., transform=...)`.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Prefetcher", "prefetch"]

_ITEM, _END, _ERROR = "item", "end", "error"
_POLL_S = 0.05  # how often a blocked producer checks for a stop request


class Prefetcher:
    """Reads ahead from a stateful iterator in a background thread.

    Args:
        iterator: an iterator with `get_state()` and `set_state(state)` (for example a
            `PipelineIterator`); plain iterators work too, without state.
        buffer_size: batches read ahead (the queue bound); memory holds up to `buffer_size + 1`
            batches beyond the one in use.
        transform: applied to each batch in the background thread (e.g. `to_torch` with a device),
            so collation and host-to-device copies overlap the training step.

    Raises:
        ValueError: if `buffer_size < 1`.

    Example:
        >>> it = prefetch(iter(range(3)), buffer_size=2)
        >>> list(it)
        [0, 1, 2]
    """

    def __init__(
        self,
        iterator: Iterator[Any],
        *,
        buffer_size: int = 2,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an int >= 1, got {buffer_size!r}.")
        self.iterator = iterator
        self.buffer_size = buffer_size
        self.transform = transform
        self._stateful = hasattr(iterator, "get_state") and hasattr(iterator, "set_state")
        self._state: Any = copy.deepcopy(iterator.get_state()) if self._stateful else None
        self._queue: queue.Queue[tuple[Any, ...]] | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._finished = False

    def _produce(self, q: queue.Queue[tuple[Any, ...]], stop: threading.Event) -> None:
        def put(item: tuple[Any, ...]) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=_POLL_S)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            while not stop.is_set():
                batch = next(self.iterator)
                state = copy.deepcopy(self.iterator.get_state()) if self._stateful else None
                if self.transform is not None:
                    batch = self.transform(batch)
                if not put((_ITEM, batch, state)):
                    return
        except StopIteration:
            put((_END,))
        except BaseException as e:  # handed to the consumer, re-raised there
            put((_ERROR, e))

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.buffer_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, args=(self._queue, self._stop), name="ember-prefetch", daemon=True
        )
        self._thread.start()

    def _halt(self) -> None:
        """Stops the producer thread and drops what it read ahead."""
        if self._thread is None:
            return
        assert self._stop is not None and self._queue is not None
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                pass
        self._thread.join()
        self._thread = self._queue = self._stop = None

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._thread is None:
            self._start()
        assert self._queue is not None
        kind, *rest = self._queue.get()
        if kind == _END:
            self._finished = True
            self._halt()
            raise StopIteration
        if kind == _ERROR:
            self._finished = True
            self._halt()
            raise rest[0]
        batch, self._state = rest
        return batch

    def get_state(self) -> Any:
        """Returns the wrapped iterator's state right after the last batch returned here.

        Raises:
            TypeError: if the wrapped iterator has no `get_state`.
        """
        if not self._stateful:
            raise TypeError(f"the wrapped iterator ({type(self.iterator).__name__}) has no get_state/set_state.")
        return copy.deepcopy(self._state)

    def set_state(self, state: Any) -> None:
        """Drops the read-ahead batches and resumes the wrapped iterator from `state`.

        Raises:
            TypeError: if the wrapped iterator has no `set_state`.
        """
        if not self._stateful:
            raise TypeError(f"the wrapped iterator ({type(self.iterator).__name__}) has no get_state/set_state.")
        self._halt()
        self.iterator.set_state(state)
        self._state = copy.deepcopy(self.iterator.get_state())
        self._finished = False

    def close(self) -> None:
        """Stops the thread and closes the wrapped iterator (if it has `close`)."""
        self._halt()
        close = getattr(self.iterator, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prefetch(
    iterator: Iterator[Any],
    *,
    buffer_size: int = 2,
    transform: Callable[[Any], Any] | None = None,
) -> Prefetcher:
    """Wraps `iterator` in a `Prefetcher`.

    Args:
        iterator: a (stateful) iterator, e.g. from `make_pipeline`.
        buffer_size: batches read ahead.
        transform: applied to each batch in the background thread, e.g.
            `functools.partial(to_torch, device="cuda")`.

    Returns:
        The `Prefetcher`.

    Example:
        >>> list(prefetch(iter([1, 2]), transform=lambda x: 10 * x))
        [10, 20]
    """
    return Prefetcher(iterator, buffer_size=buffer_size, transform=transform)
