"""SFT data: JSONL examples, the assistant-only mask, and packing that changes nothing: a packed batch
gives the loss and gradients of its documents run one by one (eager and compiled), and the pipeline
resumes where it stopped."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ember.core import jit, pytree, random
from ember.core.transforms import value_and_grad
from ember.data import ByteTokenizer
from ember.data.sft import IGNORE_INDEX, make_sft_pipeline, pack_sft, read_sft_jsonl, tokenize_sft_example
from ember.models import build_model, lm_loss


def _examples(n=7, seed=0):
    """Random `(ids, learnt)` documents of 3..40 tokens, the second half of each learnt."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 41))
        ids = rng.integers(0, 256, length).astype(np.int32)
        learnt = np.arange(length) >= length // 2
        out.append((ids, learnt))
    return out


def test_packing_restarts_positions_and_segments_and_masks_prompts():
    examples = [(np.arange(5, dtype=np.int32), np.array([0, 0, 1, 1, 1], bool)),
                (np.arange(10, 14, dtype=np.int32), np.array([0, 1, 1, 1], bool))]
    p = pack_sft(examples, seq_len=10)
    assert p["inputs"].shape == (1, 10)
    assert p["segment_ids"][0].tolist() == [1, 1, 1, 1, 2, 2, 2, 0, 0, 0]
    assert p["positions"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 0, 0]
    assert p["targets"][0].tolist() == [IGNORE_INDEX, 2, 3, 4, 11, 12, 13] + [IGNORE_INDEX] * 3
    assert p["inputs"][0, :7].tolist() == [0, 1, 2, 3, 10, 11, 12]


def test_overflow_truncates_with_a_count_or_refuses(caplog):
    long = [(np.arange(30, dtype=np.int32), np.ones(30, bool))]
    with caplog.at_level("WARNING"):
        p = pack_sft(long, seq_len=8)
    assert p["inputs"][0].tolist() == list(range(8)) and "1 example(s) longer than seq_len=8 were truncated" in caplog.text
    with pytest.raises(ValueError, match=r"example 0 has 30 tokens.*data\.overflow=truncate"):
        pack_sft(long, seq_len=8, overflow="error")


def _unpacked_loss_and_grads(model, params, examples):
    loss_fn = lm_loss(model)

    def total(p):
        sums, counts = [], []
        for ids, learnt in examples:
            ids_t = torch.as_tensor(ids, dtype=torch.long)[None]
            targets = torch.where(torch.as_tensor(learnt[1:])[None], ids_t[:, 1:], IGNORE_INDEX)
            out = loss_fn(p, {"inputs": ids_t[:, :-1], "targets": targets}, key=None)
            sums.append(out.total)
            counts.append(out.count)
        return torch.stack(sums).sum() / torch.stack(counts).sum()

    return value_and_grad(total)(params)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_packed_equals_unpacked(family, backend):
    model = build_model(family, "tiny")
    params = model.init(random.key(0))
    examples = _examples()
    packed = {k: torch.as_tensor(v) for k, v in pack_sft(examples, seq_len=64).items()}
    assert packed["inputs"].shape[0] >= 2 and packed["segment_ids"].max() >= 2  # several documents per window

    def mean_loss(p, batch):
        return lm_loss(model)(p, batch, key=None).mean()

    fn = value_and_grad(mean_loss)
    fn = jit(fn, backend="inductor") if backend == "inductor" else fn
    loss, grads = fn(params, packed)
    want_loss, want_grads = _unpacked_loss_and_grads(model, params, examples)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-5)
    for (path, g), w in zip(pytree.tree_leaves_with_path(grads), pytree.tree_leaves(want_grads)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=path)


def test_documents_never_attend_across_a_boundary():
    model = build_model("llama3", "tiny")
    params = model.init(random.key(0))
    examples = _examples(3, seed=1)
    packed = {k: torch.as_tensor(v) for k, v in pack_sft(examples, seq_len=128).items()}
    extra = {"segment_ids": packed["segment_ids"], "positions": packed["positions"]}
    logits = model.apply(params, packed["inputs"], **extra)
    changed = packed["inputs"].clone()
    first = packed["segment_ids"][0] == 1
    changed[0, first] = (changed[0, first] + 1) % 256  # rewrite document 1 only
    after = model.apply(params, changed, **extra)
    later = packed["segment_ids"][0] >= 2
    torch.testing.assert_close(after[0, later], logits[0, later], rtol=0, atol=0)
    assert (after[0, first] - logits[0, first]).abs().max() > 1e-3


def _write(path, lines):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return str(path)


def test_jsonl_lines_are_checked_with_file_and_line(tmp_path):
    good = {"prompt": "Q: 1+1?\nA:", "completion": " 2"}
    path = _write(tmp_path / "a.jsonl", [good, {"text": "no messages here"}])
    with pytest.raises(ValueError, match=r"a\.jsonl:2: expected \"messages\".*got keys \['text'\]"):
        list(read_sft_jsonl(path))
    path = _write(tmp_path / "b.jsonl", [good, "", "{not json"])
    with pytest.raises(ValueError, match=r"b\.jsonl:3: not a JSON object"):
        list(read_sft_jsonl(path))
    tok = ByteTokenizer(eos=True)
    ids, learnt = tokenize_sft_example(good, tok)
    assert tok.decode(ids[learnt]) == " 2" + "<|endoftext|>"
    with pytest.raises(ValueError, match=r"chat template.*data\.tokenizer=model"):
        tokenize_sft_example({"messages": [{"role": "user", "content": "hi"}]}, tok)


def test_the_pipeline_resumes_where_it_stopped(tmp_path):
    lines = [{"prompt": f"question {i}? ", "completion": f"answer {i * 7}."} for i in range(40)]
    path = _write(tmp_path / "sft.jsonl", lines)
    tok = ByteTokenizer(eos=True)
    it = make_sft_pipeline(path, tokenizer=tok, seq_len=64, batch_size=2, seed=3)
    first = [next(it) for _ in range(3)]
    assert set(first[0]) == {"inputs", "targets", "segment_ids", "positions"}
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    again = make_sft_pipeline(path, tokenizer=tok, seq_len=64, batch_size=2, seed=3)
    again.set_state(state)
    for want, got in zip(expected, [next(again) for _ in range(4)]):
        for k in want:
            np.testing.assert_array_equal(want[k], got[k])
