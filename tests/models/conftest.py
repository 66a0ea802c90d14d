"""Fixtures for the model tests: very small configs (fast on 2 CPU cores)."""

from __future__ import annotations

import pytest

from ember.models import GPT2Config, Llama3Config


@pytest.fixture
def gpt2_cfg() -> GPT2Config:
    """2 layers, d=32, byte vocab: a few milliseconds per forward."""
    return GPT2Config(vocab_size=256, max_seq_len=32, n_layers=2, n_heads=4, d_model=32)


@pytest.fixture
def llama3_cfg() -> Llama3Config:
    """2 layers, d=32, 4 query heads sharing 2 key/value heads, untied head."""
    return Llama3Config(
        vocab_size=256, max_seq_len=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, ffn_dim=64,
        rope_theta=10000.0, tie_embeddings=False,
    )
