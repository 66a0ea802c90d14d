"""ember.launch.loop: the outer loop logs, evaluates, resumes and names exhausted data."""

import pytest
import torch

from ember.core import TrainState
from ember.launch.loop import evaluate, train_loop
from ember.launch.metrics_log import MetricsWriter


class _Halve:
    init = staticmethod(lambda p: {})
    update = staticmethod(lambda g, s, p=None: ({k: -0.5 * v for k, v in g.items()}, s))


def _step(state, batch):
    grads = {"w": state.params["w"] - batch}
    return state.apply_gradients(grads=grads), {"loss": grads["w"].pow(2)}


def test_train_loop_logs_evaluates_and_resumes():
    writer = MetricsWriter(None)
    calls = []
    state = TrainState.create(params={"w": torch.zeros(())}, tx=_Halve())
    state = train_loop(_step, state, iter([torch.tensor(1.0)] * 3), steps=3, writer=writer, log_every=2,
                       eval_fn=lambda s: {"loss": s.params["w"]}, on_step_end=lambda i, s: calls.append(i),
                       progress=False)
    assert [r["step"] for r in writer.history] == [2, 3, 3] and calls == [1, 2, 3]
    assert writer.history[-1] == {"step": 3, "eval_loss": 0.875}
    # resuming from step 3 runs only the remaining steps
    state = train_loop(_step, state, iter([torch.tensor(1.0)] * 2), steps=5, writer=writer, log_every=1,
                       progress=False)
    assert int(state.step) == 5 and [r["step"] for r in writer.history[-2:]] == [4, 5]


def test_train_loop_names_exhausted_data():
    state = TrainState.create(params={"w": torch.zeros(())}, tx=_Halve())
    with pytest.raises(ValueError, match="ran out before step 2 of 3"):
        train_loop(_step, state, iter([torch.tensor(1.0)]), steps=3, writer=MetricsWriter(None), progress=False)


def test_evaluate_averages_and_rejects_empty():
    m = evaluate(lambda p, b: {"loss": b}, None, [torch.tensor(1.0), torch.tensor(3.0)])
    assert m["loss"].item() == 2.0
    with pytest.raises(ValueError, match="no batches"):
        evaluate(lambda p, b: {"loss": b}, None, [])
