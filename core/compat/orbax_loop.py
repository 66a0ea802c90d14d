"""orbax's event loops end with no read pending on them: each is awaited before the loop closes.

Name: `drain_orbax_loops`, called by `CheckpointManager` after it imports orbax (idempotent).

orbax-checkpoint 0.12.8 runs each synchronous call through `asyncio_utils._run_sync_via_new_loop`
(`run_until_complete`, then `loop.close()`; earlier releases used `asyncio.run`, which cancels and
awaits what is left). When one tensorstore read of a damaged step fails, the `gather` over the reads
raises at once while the others are still in flight; the loop then closes under them, and their
completions print `RuntimeError: Event loop is closed` and `Future exception was never retrieved`
tracebacks (in about half the runs of `launch/ckpt.py list` on a truncated file). The replacement
awaits the tasks still pending on the loop before it closes it (cancelling an asyncio task does not stop
its tensorstore read, which would still call back into the closed loop), and cancels what is left after
a minute.

`WORKAROUNDS["orbax_pending_reads"]` (no upstream report of it yet). `EMBER_DISABLE_PATCHES=orbax_pending_reads`
(or `all`) leaves orbax as it is. Where orbax has no such function (another release) nothing is replaced. The test that fails when orbax drains its
loops itself: `tests/core/test_compat_orbax_loop.py`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

from . import patch_enabled

__all__ = ["NAME", "drain_orbax_loops", "orbax_leaves_pending_tasks"]

NAME = "orbax_pending_reads"
_DRAIN_TIMEOUT_S = 60.0  # reads still in flight after a failure get this long to finish before they are cancelled
_T = TypeVar("_T")


def _run_sync_draining(coro: Coroutine[Any, Any, _T]) -> _T:
    """orbax's `_run_sync_via_new_loop`, ending with its pending tasks awaited (`_drain`) before the loop closes."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            _drain(loop)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _drain(loop: asyncio.AbstractEventLoop, timeout_s: float = _DRAIN_TIMEOUT_S) -> None:
    """Let the tasks still pending on `loop` finish (a cancelled task's tensorstore read would still call back
    into the loop), then cancel what is left after `timeout_s`; every exception is retrieved."""
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not pending:
        return
    _, late = loop.run_until_complete(asyncio.wait(pending, timeout=timeout_s))
    for task in late:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def _orbax_asyncio_utils() -> Any:
    try:
        from orbax.checkpoint._src import asyncio_utils
    except ImportError:  # another layout: nothing to replace
        return None
    return asyncio_utils if callable(getattr(asyncio_utils, "_run_sync_via_new_loop", None)) else None


def drain_orbax_loops() -> bool:
    """Replace orbax's loop runner with one that drains its pending tasks; True if it is (now) replaced."""
    utils = _orbax_asyncio_utils()
    if utils is None or not patch_enabled(NAME):
        return False
    utils.__dict__.setdefault("_ember_original_run_sync", utils._run_sync_via_new_loop)
    utils._run_sync_via_new_loop = _run_sync_draining
    return True


def orbax_leaves_pending_tasks() -> bool:
    """Whether orbax's own runner closes its loop with a task still pending (what the replacement mends)."""
    utils = _orbax_asyncio_utils()
    if utils is None:
        return False
    original = utils.__dict__.get("_ember_original_run_sync", utils._run_sync_via_new_loop)
    left: list = []

    async def fails_while_another_runs() -> None:
        left.append(asyncio.ensure_future(asyncio.sleep(3600)))
        await asyncio.sleep(0)
        raise OSError("a read failed")

    try:
        original(fails_while_another_runs())
    except OSError:
        pass
    pending = bool(left) and not left[0].done()
    if left:
        left[0]._log_destroy_pending = False  # asyncio's own flag: the probe's task may die pending, unlogged
    return pending
