"""Sampling with the state on a GPU: the noise, the prompt and the key live on the logits' device."""

import torch
from simulated_cuda import on_device

from ember.core import random
from ember.core.step_fns import generate, sample_token
from ember.models import build_model
from ember.models.generation import Decoder


def _llama(cuda):
    model = build_model("llama3", "tiny")
    return model, on_device(model.init(random.key(0)))


def test_sample_token_with_a_host_key_draws_on_the_logits_device(cuda):
    logits = torch.randn(2, 11).to(cuda)
    token = sample_token(logits, key=random.key(0), temperature=0.8, top_k=4, top_p=0.9)  # key on the host
    assert token.is_cuda and token.shape == (2,)
    assert torch.equal(token.cpu(), sample_token(logits, key=random.key(0, device=cuda), temperature=0.8, top_k=4,
                                                 top_p=0.9).cpu())


def test_generate_on_device(cuda):
    model, params = _llama(cuda)
    out = generate(model.apply, params, torch.tensor([[1, 2, 3]], device=cuda), max_new_tokens=3, key=random.key(0),
                   temperature=0.8, top_k=5, max_seq_len=8)
    assert out.is_cuda and out.shape == (1, 6)


def test_decoder_generate_on_device(cuda):
    model, params = _llama(cuda)
    decoder = Decoder(model, backend="eager")
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]], device=cuda)
    sampled = decoder.generate(params, prompt, max_new_tokens=3, key=random.key(0), temperature=0.8, top_p=0.9,
                               stop_tokens=[7])
    greedy = decoder.generate(params, prompt, max_new_tokens=3, temperature=0.0)
    assert sampled.is_cuda and greedy.is_cuda and greedy.shape == (2, 6)
