"""Both families under `torch.compile(fullgraph=True)` match eager (one compile for both)."""

from __future__ import annotations

import pytest
import torch

from ember.core import random
from ember.core.testing import assert_trees_all_close
from ember.models import GPT2, GPT2Config, Llama3, Llama3Config

GPT2_TINY = GPT2Config(vocab_size=256, max_seq_len=16, n_layers=1, n_heads=2, d_model=32, dropout=0.1)
LLAMA_TINY = Llama3Config(
    vocab_size=256, max_seq_len=16, n_layers=1, n_heads=4, n_kv_heads=2, d_model=32, ffn_dim=64, rope_theta=10000.0,
    scan_layers=True,
)


@pytest.fixture(scope="module")
def compiled_forward():
    """One compiled function running GPT-2 (with dropout, keyed) and Llama-3 (scan form)."""
    gpt2, llama = GPT2(GPT2_TINY), Llama3(LLAMA_TINY)

    def forward(params, tokens, key):
        return gpt2.apply(params["gpt2"], tokens, key=key), llama.apply(params["llama3"], tokens)

    params = {"gpt2": gpt2.init(random.key(0)), "llama3": llama.init(random.key(1))}
    return forward, torch.compile(forward, fullgraph=True), params


@pytest.mark.slow
def test_compiled_forward_matches_eager(compiled_forward):
    eager, compiled, params = compiled_forward
    tokens = random.randint(random.key(2), (2, 16), 0, 256)
    key = random.key(3)
    want = eager(params, tokens, key)
    got = compiled(params, tokens, key)
    # Inductor fuses and reorders float32 reductions; dropout masks are bit-identical.
    assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
