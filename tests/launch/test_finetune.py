"""The README's fine-tune paths on a few steps: launch/tiny_chat.py builds a Hugging Face folder and a chat
JSONL here; `--config tiny_chat_sft` (`make finetune`) fine-tunes the Qwen2 one and samples a reply, and the
"Fine-tuning a Hugging Face folder" commands (`--config sft`, LoRA flags, `ckpt.py export --hf`) a Gemma one."""

import json
import os
import sys

import pytest
import torch

from ember.core import pytree
from ember.core.checkpoint import CheckpointManager
from ember.data import load_model_tokenizer
from ember.launch import train
from ember.launch.build import build_model as build_run_model
from ember.launch.build import initial_state
from ember.launch.init_from import check_init_from
from ember.launch.run_config import parse_cli
from ember.launch.tiny_chat import CHATML, build
from ember.models import from_hf, to_lora

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _readme_runs import run_readme_commands  # noqa: E402


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


FAST = ["--steps", "2", "--eval_every", "2", "--eval_batches", "1", "--log_every", "1", "--sample_tokens", "0",
        "--backend", "eager", "--data.seq_len", "128", "--data.batch_size", "2"]
"""Appended to the README's training commands: 2 eager steps on short windows (the flags as written still parse)."""


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    """The README's "Fine-tuning a Hugging Face folder" commands, run in order in an empty folder."""
    root = tmp_path_factory.mktemp("readme")
    return root, run_readme_commands(root, "### Fine-tuning a Hugging Face folder", FAST)


def test_the_readme_fine_tunes_a_gemma_folder_with_the_generic_sft_config(readme_runs):
    root, histories = readme_runs
    saved = json.loads((root / "runs/sft_gemma/config.json").read_text())
    assert saved["family"] == "gemma" and saved["model"]["__type__"] == "GemmaConfig"
    assert saved["data"]["tokenizer_path"] == "runs/tiny_gemma/model" and saved["data"]["seq_len"] == 128
    evals = [r["eval_loss"] for r in histories["runs/sft_gemma"] if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] < evals[0], evals


def test_the_readme_lora_run_exports_merged_weights_that_transformers_loads(readme_runs):
    """The export holds base + (alpha / r) * B @ A: transformers' logits equal the LoRA model's, and the
    tokenizer files and chat template of the folder the run started from came along."""
    transformers = pytest.importorskip("transformers")
    root, _ = readme_runs
    folder, hf_dir = root / "runs/tiny_gemma/model", root / "runs/lora_gemma/hf"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (hf_dir / name).read_bytes() == (folder / name).read_bytes(), name
    assert transformers.AutoTokenizer.from_pretrained(hf_dir).chat_template == CHATML
    base, base_params = from_hf(folder)
    model = to_lora(base, rank=8, alpha=16.0, targets=("wq", "wv"))
    with CheckpointManager(root / "runs/lora_gemma/checkpoints", read_only=True) as saved:
        params = saved.restore_params(like=model.param_shapes())
    pytree.tree_map(lambda x, y: torch.testing.assert_close(x, y, rtol=0, atol=0), params["base"], base_params)
    assert params["lora"]["blocks"]["attn"]["wq"]["weight"]["b"].abs().max() > 0  # the adapters trained
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        theirs = reference(tokens).logits
    torch.testing.assert_close(model.apply(params, tokens), theirs, rtol=0, atol=1e-4)
    assert not torch.allclose(base.apply(base_params, tokens), theirs, atol=1e-4)  # the merge changed the model
    again = parse_cli("sft", ["--init_from", str(root / "runs/lora_gemma")])  # a LoRA run starts another merged
    assert again.family == "gemma" and again.lora.rank == 0
    started = initial_state(again, build_run_model(again)).params
    pytree.tree_map(lambda x, y: torch.testing.assert_close(x, y, rtol=0, atol=0), started, model.merged(params))


def test_the_qwen2_sft_config_points_a_gemma_folder_at_config_sft(readme_runs):
    root, _ = readme_runs
    folder = str(root / "runs/tiny_gemma/model")
    cfg = parse_cli("tiny_chat_sft", ["--init_from", folder])
    with pytest.raises(ValueError, match=r"holds a gemma model and the run config a qwen2 one .*pass --config sft"):
        check_init_from(folder, cfg.family, cfg.model, config_name="tiny_chat_sft")
    with pytest.raises(ValueError, match=r"^this run config takes its model from the weights it starts from: pass "
                                         r"--init_from FOLDER"):
        parse_cli("sft", ["--data.path", "chat.jsonl"])
    lora = parse_cli("sft", ["--init_from", folder, "--lora.rank", "4", "--model.scan_layers"])
    assert (lora.family, lora.model.scan_layers, lora.lora.rank, lora.data.tokenizer_path) == ("gemma", True, 4, folder)
