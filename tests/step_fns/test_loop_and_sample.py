"""Tests for the outer train loop and the pure sampler."""

import pytest
import torch

from ember.core import TrainState, random
from ember.core.metrics_log import MetricsWriter
from ember.core.step_fns.loop import evaluate, train_loop
from ember.core.step_fns.sample import generate, sample_token


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


def test_sample_token_greedy_topk_and_determinism():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]])
    assert sample_token(logits, temperature=0.0).tolist() == [1]
    k = random.key(3)
    draws = torch.stack([sample_token(logits, key=random.fold_in(k, i), top_k=2) for i in range(200)])
    assert set(draws.flatten().tolist()) <= {1, 3}  # top_k=2 keeps only the two best
    assert torch.equal(sample_token(logits, key=k), sample_token(logits, key=k))
    with pytest.raises(ValueError, match="needs `key=`"):
        sample_token(logits, temperature=1.0)


def test_generate_with_a_toy_model():
    # a "model" that always predicts token (last + 1) % 5
    def apply(params, tokens):
        nxt = (tokens + 1) % 5
        return torch.nn.functional.one_hot(nxt, 5).float() * 10.0

    out = generate(apply, None, torch.tensor([[0]]), max_new_tokens=6, temperature=0.0, max_seq_len=4)
    assert out.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    with pytest.raises(ValueError, match="prompt must be"):
        generate(apply, None, torch.tensor([0]), max_new_tokens=1)
