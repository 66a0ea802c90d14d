"""SFT data: JSONL examples, the assistant-only mask, and packing that changes nothing: a packed batch
gives the loss and gradients of its documents run one by one (eager and compiled), and the pipeline
resumes where it stopped."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from _packed_parity import examples, run
from ember.core import random
from ember.data import ByteTokenizer
from ember.data.sft import IGNORE_INDEX, make_sft_pipeline, pack_sft, read_sft_jsonl, tokenize_sft_example
from ember.models import build_model

SCRIPT = pathlib.Path(__file__).with_name("_packed_parity.py")


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
    with pytest.raises(ValueError, match=r"^examples\[0\]: 30 tokens, more than a window of --data\.seq_len 8 \(\+1\) "
                                         r"holds; raise --data\.seq_len, or pass --data\.overflow truncate to cut"):
        pack_sft(long, seq_len=8, overflow="error")


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_packed_equals_unpacked(family, backend):
    diff = run(family, backend)
    assert diff["loss"] < 1e-5 and diff["grads"] < 1e-5, diff


@pytest.mark.slow
@pytest.mark.xla
def test_packed_equals_unpacked_on_xla():
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "xla"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for family, diff in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert diff["loss"] < 1e-5 and diff["grads"] < 1e-5, (family, diff)


def test_documents_never_attend_across_a_boundary():
    model = build_model("llama3", "tiny")
    params = model.init(random.key(0))
    docs = examples(3, seed=1)
    packed = {k: torch.as_tensor(v) for k, v in pack_sft(docs, seq_len=128).items()}
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


def test_every_20th_example_is_the_eval_split_and_the_path_is_checked(tmp_path):
    path = _write(tmp_path / "sft.jsonl", [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(40)])
    tok = ByteTokenizer(eos=True)

    def segments(split):
        it = make_sft_pipeline(path, tokenizer=tok, seq_len=64, batch_size=1, shuffle=False, repeat=False, split=split)
        return sum(int(b["segment_ids"].max()) for b in it)

    assert (segments("train"), segments("eval"), segments(None)) == (38, 2, 40)
    with pytest.raises(ValueError, match=r"is not a file; data\.source=sft reads one JSONL file"):
        make_sft_pipeline(str(tmp_path), tokenizer=tok, seq_len=64, batch_size=1)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A model folder's tokenizer with a ChatML-style template that prints any role it is given."""
    from ember.data import load_model_tokenizer, train_bpe

    d = tmp_path_factory.mktemp("chat_model")
    train_bpe(["hello there, how are you? fine thanks"] * 20, vocab_size=300,
              special_tokens=["<|im_start|>", "<|im_end|>"]).save(d / "tokenizer.json")
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    return load_model_tokenizer(d)


def _chat(user, reply="fine", role="assistant"):
    return {"messages": [{"role": "user", "content": user}, {"role": role, "content": reply}]}


def test_text_parts_are_joined_and_train_like_the_same_string(tmp_path, chat_tokenizer):
    parts = [{"type": "text", "text": "hello there"}, {"type": "text", "text": "how are you?"}]
    path = _write(tmp_path / "parts.jsonl", [_chat(parts, reply=[{"type": "text", "text": "fine thanks"}]),
                                             _chat("hello there\nhow are you?", reply="fine thanks")])
    (a, b) = [tokenize_sft_example(e, chat_tokenizer) for e in read_sft_jsonl(path)]
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert "user\nhello there\nhow are you?<|im_end|>" in chat_tokenizer.decode(a[0])  # the text, not the list's repr
    assert chat_tokenizer.decode(a[0][a[1]]) == "fine thanks<|im_end|>\n"


SFT_MISTAKES = [  # (line 2 of the file, the error's text after "bad.jsonl:2: ")
    (_chat([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x.png"}}]),
     r"messages\[0\]\.content\[1\] is a 'image_url' part; SFT trains on text only: keep the \{\"type\": \"text\""),
    (_chat({"text": "hi"}), r"messages\[0\]\.content is dict \{\"text\": \"hi\"\}; expected a string or a list of"),
    (_chat("hi", role="assitant"), r"messages\[1\] has role 'assitant', which the chat template of .* does not know; "
                                   r"expected one of \['assistant', 'system', 'tool', 'user'\] .* Did you mean 'assistant'\?"),
    (_chat("hi", role="narrator"), r"messages\[1\] has role 'narrator'.*Rename the role, or use a template that names it"),
    (_chat("hello " * 40), r"\d+ tokens, more than a window of --data\.seq_len 32 \(\+1\) holds; raise --data\.seq_len, "
                           r"or pass --data\.overflow truncate"),
]


@pytest.mark.parametrize("line, match", SFT_MISTAKES, ids=["image-part", "dict-content", "role-typo", "unknown-role",
                                                           "overflow"])
def test_sft_mistakes_name_the_file_and_line(tmp_path, chat_tokenizer, line, match):
    path = _write(tmp_path / "bad.jsonl", [_chat("hello there"), line])
    with pytest.raises(ValueError, match=f"^{tmp_path / 'bad.jsonl'}:2: {match}"):
        make_sft_pipeline(path, tokenizer=chat_tokenizer, seq_len=32, batch_size=1, overflow="error")
