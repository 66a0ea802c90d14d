"""The README's fine-tune path (`make finetune`) on a few steps: launch/tiny_chat.py builds a Hugging
Face folder and a chat JSONL here, and `--config tiny_chat_sft` fine-tunes it and samples a reply."""

import json

import pytest

from ember.data import load_model_tokenizer
from ember.launch import train
from ember.launch.tiny_chat import build


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_chat")
    return build(str(out)), str(out / "chat.jsonl")


def test_the_folder_is_a_transformers_checkpoint_with_a_chat_template(tiny_chat):
    transformers = pytest.importorskip("transformers")
    folder, jsonl = tiny_chat
    messages = json.loads(open(jsonl).readline())["messages"]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ours = load_model_tokenizer(folder)
    assert ours.apply_chat_template(messages).tolist() == list(hf.apply_chat_template(messages, tokenize=True,
                                                                                     return_dict=True)["input_ids"])
    assert type(transformers.AutoModelForCausalLM.from_pretrained(folder)).__name__ == "Qwen2ForCausalLM"


def test_tiny_chat_sft_fine_tunes_the_folder_and_samples_a_reply(tiny_chat, tmp_path, capsys):
    folder, jsonl = tiny_chat
    history = train.main(["--config", "tiny_chat_sft", "--init_from", folder, "--data.tokenizer_path", folder,
                          "--data.path", jsonl, "--out", str(tmp_path / "run"), "--steps", "12", "--eval_every", "12",
                          "--log_every", "4", "--eval_batches", "2", "--backend", "eager", "--sample_tokens", "8"])
    out = capsys.readouterr().out
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    assert evals[-1] < evals[0], evals
    assert "<|im_start|>user\nWhat is the json module for?<|im_end|>\n<|im_start|>assistant\n" in out


def test_the_sft_path_fine_tunes_a_qwen3_moe_folder(tmp_path, capsys):
    """`launch/tiny_chat.py --config qwen3_moe_tiny` writes a Qwen3-MoE folder; the SFT flags fine-tune it."""
    folder = build(str(tmp_path / "chat"), config="qwen3_moe_tiny")
    history = train.main(["--config", "qwen3_moe_tiny", "--init_from", folder, "--data.source", "sft",
                          "--data.path", str(tmp_path / "chat" / "chat.jsonl"), "--data.tokenizer", "model",
                          "--data.tokenizer_path", folder, "--data.seq_len", "64", "--data.batch_size", "4",
                          "--out", str(tmp_path / "run"), "--steps", "8", "--eval_every", "8", "--log_every", "4",
                          "--eval_batches", "1", "--backend", "eager", "--sample_tokens", "0"])
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    assert evals[-1] < evals[0], evals
    assert all("moe_aux_loss" in r for r in history if "loss" in r)
