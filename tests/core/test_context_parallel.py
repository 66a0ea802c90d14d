"""Context parallelism's pieces on one device: the head-tail order, the data pipeline's `ContextOrder`
(every (B, T) array moved alike, resumable), and attention on a reordered sequence equal to attention on
the original (causal, packed documents, padding, a sliding window)."""

import numpy as np
import pytest
import torch

from ember.core.partition_specs.context_parallel import ContextParallelError, context_attention, head_tail_order
from ember.data import ContextOrder, make_pipeline
from ember.models.layers import dot_product_attention, repeat_kv


@pytest.mark.parametrize("seq_len,cp", [(8, 2), (24, 3), (16, 4)])
def test_head_tail_order_balances_the_causal_pairs(seq_len, cp):
    order = head_tail_order(seq_len, cp)
    assert sorted(order) == list(range(seq_len))
    per_process = [order[r * seq_len // cp:(r + 1) * seq_len // cp] for r in range(cp)]
    pairs = [sum(i + 1 for i in part) for part in per_process]  # keys each process's queries see
    assert len(set(pairs)) == 1, pairs


def test_a_sequence_that_does_not_split_names_the_fix():
    with pytest.raises(ContextParallelError, match=r"multiple of 4 \(--data.seq_len\)"):
        head_tail_order(30, 2)
    with pytest.raises(ContextParallelError, match="multiple of 4"):
        ContextOrder(2, seq_len=30)


def test_context_order_moves_every_array_and_carries_index_and_positions():
    batch = {"inputs": np.arange(16).reshape(2, 8), "targets": np.arange(1, 17).reshape(2, 8),
             "positions": np.array([[0, 1, 2, 0, 1, 2, 3, 4]] * 2), "meta": np.array([7, 9])}
    out = ContextOrder(2)(batch)
    order = head_tail_order(8, 2)
    for name in ("inputs", "targets", "positions"):
        np.testing.assert_array_equal(out[name], batch[name][:, order])
    np.testing.assert_array_equal(out["token_index"], np.array([order, order]))
    np.testing.assert_array_equal(out["meta"], batch["meta"])  # not (B, T): left alone
    assert ContextOrder(1)(batch) is batch


def test_the_reordered_pipeline_resumes_exactly():
    tokens = np.arange(5000) % 251
    kwargs = dict(seq_len=16, batch_size=2, seed=3)
    plain = make_pipeline(tokens, **kwargs)
    it = make_pipeline(tokens, context_parallel=2, **kwargs)
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    later = [next(it) for _ in range(2)]
    order = head_tail_order(16, 2)
    for got in first:
        want = next(plain)
        np.testing.assert_array_equal(got["inputs"], want["inputs"][:, order])
    again = make_pipeline(tokens, context_parallel=2, **kwargs)
    again.set_state(state)
    for want in later:
        got = next(again)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


CASES = {
    "causal": {},
    "packed": {"segment_ids": torch.tensor([[1, 1, 1, 2, 2, 2, 2, 3], [1, 1, 1, 1, 1, 2, 2, 0]])},
    "padding": {"padding_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])},
    "window": {"window": 3},
}


@pytest.mark.parametrize("kv_heads", [6, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_on_a_reordered_sequence_equals_the_original(case, kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 8, 4, generator=g, dtype=torch.float64)  # (B, H, T, D)
    k, v = (torch.randn(2, kv_heads, 8, 4, generator=g, dtype=torch.float64) for _ in range(2))  # (B, KV, T, D)
    kwargs = CASES[case]
    want = dot_product_attention(q, repeat_kv(k, 6 // kv_heads), repeat_kv(v, 6 // kv_heads), **kwargs)
    order = torch.tensor(head_tail_order(8, 2))
    moved = {n: t[:, order] if isinstance(t, torch.Tensor) else t for n, t in kwargs.items()}
    got = dot_product_attention(q[:, :, order], k[:, :, order], v[:, :, order], token_index=order.expand(2, 8),
                                **moved)
    torch.testing.assert_close(got, want[:, :, order], rtol=0, atol=1e-12)


def test_context_attention_without_a_split_sequence_is_attend_itself():
    q = torch.randn(1, 2, 4, 3)
    seen = {}

    def attend(q_, k_, v_, queries, keys):
        seen.update(queries=queries, keys=keys)
        return q_

    assert context_attention(attend, q, q, q, tokens={"index": torch.arange(4)}) is q
    assert seen["queries"] is seen["keys"]


def test_a_llama_gives_the_same_loss_on_the_reordered_batch():
    from ember.core import random
    from ember.models import build_model, lm_loss

    model = build_model("llama3", "tiny", vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                        ffn_dim=64, max_seq_len=16)
    params = model.init(random.key(0))
    tokens = random.randint(random.key(1), (2, 17), 0, 64)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    moved = {n: torch.from_numpy(np.ascontiguousarray(t)) for n, t in
             ContextOrder(2)({n: t.numpy() for n, t in batch.items()}).items()}
    want, got = (lm_loss(model)(params, b, key=None) for b in (batch, moved))
    torch.testing.assert_close(got.total, want.total, rtol=1e-6, atol=0)  # a sum of 32 losses, in another order
    assert int(got.count) == int(want.count)
