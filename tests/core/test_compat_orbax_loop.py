"""ember.core.compat.orbax_loop: orbax's loops end with no task pending, and the test that says when orbax does it.

The command-line case (`ckpt.py list` of a truncated step printed asyncio tracebacks) is
tests/launch/test_new_user_sweep.py::test_ckpt_list_of_a_damaged_step_prints_its_verdict_and_no_asyncio_traceback.
"""

import asyncio

import pytest

pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is an ember dependency")

from ember.core.compat import orbax_loop  # noqa: E402


def test_orbax_still_closes_its_loop_with_a_task_pending():
    # Fails once orbax awaits or cancels its pending tasks itself: then drop compat/orbax_loop.py.
    if orbax_loop._orbax_asyncio_utils() is None:
        pytest.skip("this orbax has no _run_sync_via_new_loop (before 0.12.8 it ran asyncio.run, which drains): "
                    "the replacement steps aside")
    assert orbax_loop.orbax_leaves_pending_tasks()


def _reads(finished: list, *, read_s: float):
    async def fails_while_another_reads() -> None:
        async def read() -> None:
            await asyncio.sleep(read_s)
            finished.append("read")

        finished.append(asyncio.ensure_future(read()))
        await asyncio.sleep(0)
        raise OSError("OUT_OF_RANGE: a truncated file")

    return fails_while_another_reads()


def test_the_replacement_lets_a_pending_read_finish_before_the_loop_closes():
    finished: list = []
    with pytest.raises(OSError, match="truncated"):
        orbax_loop._run_sync_draining(_reads(finished, read_s=0.05))
    task = finished[0]
    assert task.done() and not task.cancelled() and finished[1:] == ["read"]


def test_a_read_still_pending_after_the_timeout_is_cancelled_and_awaited():
    finished: list = []
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(OSError):
            loop.run_until_complete(_reads(finished, read_s=3600))
        orbax_loop._drain(loop, timeout_s=0.05)
        assert finished[0].cancelled()
    finally:
        loop.close()


def test_the_replacement_is_installed_unless_disabled(monkeypatch):
    from orbax.checkpoint._src import asyncio_utils

    monkeypatch.setenv("EMBER_DISABLE_PATCHES", "orbax_pending_reads")
    before = asyncio_utils._run_sync_via_new_loop
    assert not orbax_loop.drain_orbax_loops() and asyncio_utils._run_sync_via_new_loop is before
    monkeypatch.setenv("EMBER_DISABLE_PATCHES", "")
    assert orbax_loop.drain_orbax_loops() and asyncio_utils._run_sync_via_new_loop is orbax_loop._run_sync_draining
