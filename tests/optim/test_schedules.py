"""Schedules are pure tensor functions of the count: float32 0-d results on the count's device,
no Python branching on the count (they trace whole under torch.compile), and optax's semantics
(checked value by value in test_optax_parity.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from ember import optim

SCHEDULES = [
    ("constant", optim.constant_schedule(0.5)),
    ("constant_tensor", optim.constant_schedule(torch.tensor(0.5, dtype=torch.float64))),
    ("linear", optim.linear_schedule(1.0, 0.0, transition_steps=10, transition_begin=3)),
    ("polynomial", optim.polynomial_schedule(1.0, 0.0, power=3, transition_steps=10)),
    ("cosine", optim.cosine_decay_schedule(1.0, 10, alpha=0.1)),
    ("warmup_cosine", optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=3, decay_steps=10)),
    ("warmup_constant", optim.warmup_constant_schedule(0.0, 1.0, warmup_steps=3)),
    *[(f"wsd_{shape}", optim.warmup_stable_decay_schedule(1.0, 2, 12, 5, end_value=0.1, decay=shape))
      for shape in ("linear", "cosine", "1-sqrt")],
    (
        "join",
        optim.join_schedules(
            [optim.constant_schedule(2.0), optim.linear_schedule(2.0, 0.0, 5)], [4]
        ),
    ),
]
IDS = [s[0] for s in SCHEDULES]
SCHEDULE_FNS = [s[1] for s in SCHEDULES]


@pytest.mark.parametrize("schedule", SCHEDULE_FNS, ids=IDS)
def test_returns_float32_scalar_on_the_counts_device(schedule):
    for count in (torch.tensor(0), torch.tensor(7), torch.tensor(2**40)):
        value = schedule(count)
        assert value.shape == () and value.dtype == torch.float32
    meta = schedule(torch.zeros((), dtype=torch.int64, device="meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.float32
    assert schedule(5).item() == schedule(torch.tensor(5)).item()  # a Python int works in the REPL


@pytest.mark.parametrize("schedule", SCHEDULE_FNS, ids=IDS)
def test_traces_without_branching_on_the_count(schedule):
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(schedule, backend=counter, fullgraph=True)
    for count in range(0, 14):
        assert compiled(torch.tensor(count)).item() == schedule(torch.tensor(count)).item()
    assert counter.frame_count == 1  # one graph for every count: nothing specialised on its value
    torch._dynamo.reset()


def test_shapes_of_the_common_schedules():
    at = lambda s, t: s(torch.tensor(t)).item()  # noqa: E731
    warm = optim.warmup_cosine_decay_schedule(
        0.0, 1.0, warmup_steps=4, decay_steps=12, end_value=0.1
    )
    assert [at(warm, t) for t in (0, 2, 4)] == [0.0, 0.5, 1.0]
    assert at(warm, 8) == pytest.approx(0.55)  # halfway down the cosine: (1 + 0.1) / 2
    assert at(warm, 12) == pytest.approx(0.1) and at(warm, 1000) == pytest.approx(0.1)
    lin = optim.linear_schedule(1.0, 0.0, transition_steps=10, transition_begin=3)
    assert [at(lin, t) for t in (0, 3, 8, 13, 20)] == pytest.approx([1.0, 1.0, 0.5, 0.0, 0.0])


def test_wsd_holds_the_peak_then_decays_its_tail_by_its_shape():
    at = lambda s, t: s(torch.tensor(t)).item()  # noqa: E731
    for shape, half in (("linear", 0.55), ("cosine", 0.55), ("1-sqrt", 0.1 + 0.9 * (1 - 0.5 ** 0.5))):
        wsd = optim.warmup_stable_decay_schedule(1.0, warmup_steps=4, total_steps=20, decay_steps=8, end_value=0.1,
                                                 decay=shape)
        assert [at(wsd, t) for t in (0, 2, 4, 8, 12)] == [0.0, 0.5, 1.0, 1.0, 1.0]  # warmup, then the peak held
        assert at(wsd, 16) == pytest.approx(half)  # halfway down the tail
        assert at(wsd, 20) == pytest.approx(0.1) and at(wsd, 10**6) == pytest.approx(0.1)


def test_wsd_refuses_a_tail_that_does_not_fit_and_an_unknown_shape():
    with pytest.raises(ValueError, match=r"warmup_steps \+ decay_steps <= total_steps.*decay_steps ~ total_steps / 5"):
        optim.warmup_stable_decay_schedule(1.0, warmup_steps=10, total_steps=20, decay_steps=15)
    with pytest.raises(ValueError, match="decay='exp' is not a tail shape; choose one of linear, cosine, 1-sqrt"):
        optim.warmup_stable_decay_schedule(1.0, 1, 10, 2, decay="exp")


def test_the_run_configs_wsd_schedule():
    cfg = optim.OptimConfig(learning_rate=2.0, schedule="wsd", warmup_steps=5, decay_fraction=0.25,
                            end_lr_ratio=0.0, decay_shape="1-sqrt")
    lr = optim.schedule_from_config(cfg, total_steps=100)
    values = [lr(torch.tensor(t)).item() for t in (0, 5, 74, 75, 100)]
    assert values[:4] == [0.0, 2.0, 2.0, 2.0] and values[4] == 0.0
    assert lr(torch.tensor(100 - 25 + 4)).item() == pytest.approx(2.0 * (1 - (4 / 25) ** 0.5))  # 1-sqrt of the tail
    with pytest.raises(ValueError, match="decay_fraction"):
        optim.OptimConfig(schedule="wsd", decay_fraction=1.5)
