"""The pure sampler: greedy, top-k, determinism from keys, generation with a toy model."""

import pytest
import torch

from ember.core import random
from ember.core.step_fns.sample import generate, sample_token


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
