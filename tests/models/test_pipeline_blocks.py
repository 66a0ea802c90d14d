"""A model's stacked blocks through `ember.core.partition_specs.pipeline`: Llama's logits and gradients as
without it."""

import pytest
import torch

from ember.core import random
from ember.core.pytree import tree_flatten, tree_unflatten
from ember.core.partition_specs.pipeline import pipeline
from ember.models import build_model, get_config


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # SDPA's batching rule is a loop over stages
@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 2, 1), (2, 4, 2)])
def test_llama_blocks_as_a_pipeline_give_the_same_logits_and_gradients(stages, microbatches, repeats):
    cfg = get_config("llama3", "tiny").replace(n_layers=4, scan_layers=True)
    model = build_model("llama3", cfg)
    params = model.init(random.key(0))
    tokens = random.randint(random.key(1), (4, 16), 0, cfg.vocab_size)
    positions = torch.arange(16)
    block = model.declare()["blocks"].layer
    head_name, head = model.head()

    def logits(params):
        h = pipeline(lambda p, h: block.apply(p, h, positions=positions), params["blocks"],
                     model.embed(params, tokens, positions=positions), stages=stages, microbatches=microbatches,
                     repeats=repeats)
        return head(params[head_name], model.call("ln_f", params, h)).float()

    def grads(fn):
        flat, spec = tree_flatten(params)
        flat = [t.detach().requires_grad_() for t in flat]
        out = fn(tree_unflatten(flat, spec))
        return out.detach(), torch.autograd.grad(out.square().mean(), flat)

    (got, got_grads), (want, want_grads) = grads(logits), grads(lambda p: model.apply(p, tokens))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
