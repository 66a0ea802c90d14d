"""Causal attention with a mask (packed documents, a sliding window) runs in chunks of queries once
the sequence is long enough; the chunks give the one-call result, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from ember.core import jit, random
from ember.core.transforms import grad
from ember.models.layers.attention import QUERY_CHUNK, attention_mask, dot_product_attention


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("masking", ["segments", "window"])
def test_query_chunks_equal_one_masked_call(masking, backend):
    t = 2 * QUERY_CHUNK + 37  # three chunks, the last one short
    k = random.split(random.key(0), 3)
    q, kk, v = (random.normal(k[i], (2, 4, t, 16)) for i in range(3))
    segments = (torch.arange(t) * 5 // t)[None].expand(2, t) if masking == "segments" else None
    window = 100 if masking == "window" else None
    mask = attention_mask(t, segment_ids=segments, window=window)

    def chunked(qkv):
        return dot_product_attention(*qkv, segment_ids=segments, window=window).square().sum()

    def one_call(qkv):
        return F.scaled_dot_product_attention(*qkv, attn_mask=mask).square().sum()

    fn = jit(grad(chunked), backend=backend) if backend == "inductor" else grad(chunked)
    got, want = fn((q, kk, v)), grad(one_call)((q, kk, v))
    torch.testing.assert_close(dot_product_attention(q, kk, v, segment_ids=segments, window=window),
                               F.scaled_dot_product_attention(q, kk, v, attn_mask=mask), rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
