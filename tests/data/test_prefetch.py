"""The prefetching wrapper: read-ahead in a thread, state of the batch handed out."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from ember.data import make_pipeline, prefetch, to_torch


@pytest.fixture
def ramp():
    return np.arange(2001, dtype=np.uint16)


def test_state_is_that_of_the_last_batch_returned(ramp):
    kw = dict(seq_len=10, batch_size=4, seed=0)
    p = prefetch(make_pipeline(ramp, **kw), buffer_size=3)
    assert p.get_state()["next_batch"] == 0
    first = [next(p) for _ in range(4)]
    time.sleep(0.2)  # let the thread fill its queue: the wrapped iterator is now ahead
    assert p.iterator.get_state()["next_batch"] > 4
    state = p.get_state()
    assert state["next_batch"] == 4
    rest = [next(p) for _ in range(5)]
    p.close()
    fresh = make_pipeline(ramp, **kw)
    fresh.set_state(state)
    for want in rest:
        np.testing.assert_array_equal(next(fresh)["inputs"], want["inputs"])
    reference = make_pipeline(ramp, **kw)
    np.testing.assert_array_equal(next(reference)["inputs"], first[0]["inputs"])


def test_set_state_drops_read_ahead(ramp):
    with prefetch(make_pipeline(ramp, seq_len=10, batch_size=4)) as p:
        s0 = p.get_state()
        a = [next(p)["inputs"] for _ in range(3)]
        p.set_state(s0)
        b = [next(p)["inputs"] for _ in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_transform_runs_in_thread_and_end_and_errors_propagate(ramp):
    it = make_pipeline(ramp, seq_len=100, batch_size=5, repeat=False)
    batches = list(prefetch(it, transform=functools.partial(to_torch, device="cpu")))
    assert len(batches) == 4 and all(isinstance(b["inputs"], torch.Tensor) for b in batches)

    def boom(_):
        raise RuntimeError("collate failed")

    p = prefetch(iter([1, 2]), transform=boom)
    with pytest.raises(RuntimeError, match="collate failed"):
        next(p)
    with pytest.raises(TypeError, match="has no get_state"):
        p.get_state()
    with pytest.raises(ValueError, match="buffer_size must be an int >= 1"):
        prefetch(iter([]), buffer_size=0)
