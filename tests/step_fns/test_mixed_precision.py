"""Mixed precision as users expect it (`train_step(compute_dtype=torch.bfloat16)` on a language model): the
model computes in bf16 from float32 master weights, the cross-entropy (its log-softmax too) is float32 on
the bf16 logits, gradients reach the optimizer in float32 and its state stays float32 (chunked head too)."""

import pytest
import torch

from ember.core import TrainState, random
from ember.core.pytree import tree_leaves, tree_map
from ember.core.step_fns import cross_entropy, train_step
from ember.models import build_model, lm_loss
from ember.optim import adamw


class RecordingTx:
    """adamw that records the dtypes of the gradients it is given."""

    def __init__(self):
        self.inner, self.grad_dtypes = adamw(1e-3), set()

    def init(self, params):
        return self.inner.init(params)

    def update(self, grads, state, params=None):
        self.grad_dtypes |= {g.dtype for g in tree_leaves(grads)}
        return self.inner.update(grads, state, params)


@pytest.mark.parametrize("chunk", [0, 16], ids=["full_logits", "chunked_head"])
def test_bf16_compute_keeps_float32_master_weights_loss_gradients_and_optimizer(chunk):
    model = build_model("llama3", "tiny", n_layers=1, loss_chunk_size=chunk)
    params = model.init(random.key(0))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 17), generator=gen)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    tx = RecordingTx()
    state = TrainState.create(params=params, tx=tx, key=random.key(1))
    new_state, metrics = train_step(lm_loss(model), compute_dtype=torch.bfloat16)(state, batch)

    assert {t.dtype for t in tree_leaves(new_state.params)} == {torch.float32}
    assert {t.dtype for t in tree_leaves(new_state.opt_state) if t.is_floating_point()} == {torch.float32}
    assert tx.grad_dtypes == {torch.float32}
    assert metrics["loss"].dtype == torch.float32 and metrics["grad_norm"].dtype == torch.float32
    # the head computes in bf16 and hands its logits on upcast; the cross-entropy of those is float32
    logits = model.apply(tree_map(lambda p: p.to(torch.bfloat16), params), batch["inputs"])
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.to(torch.bfloat16).float())
    expected = cross_entropy(logits, batch["targets"])
    torch.testing.assert_close(metrics["loss"], expected, rtol=1e-5, atol=1e-5)
