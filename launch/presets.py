"""Built-in run configs, registered with `ember.launch.run_config` when this module is imported.

Public names: `llama3_tiny`, `gpt2_tiny`, `qwen2_tiny`, `mistral_tiny`, `qwen3_moe_tiny`, `deepseek_v3_tiny`,
`tiny_chat_sft`, `sft`, `tiny_chat_dpo`, `dpo`,
`llama3_125m` (the functions building each config).

`llama3_tiny` is the default of `launch/train.py` and `make train`: a small Llama-style model
trained on the running interpreter's standard library sources in a few CPU minutes. Vocabularies
are the byte tokenizer's 257 ids (256 bytes + EOS) padded up to a multiple of 64 (nanoGPT's
trick: friendlier matmul shapes; the unused rows are never sampled). A docstring's "~N.NM-parameter"
is the built model's count (tests/launch/test_presets.py checks it).

Example:
    >>> from ember.launch.run_config import get_config
    >>> cfg = get_config("llama3_tiny")
    >>> cfg.family, cfg.model.vocab_size
    ('llama3', 320)
"""

from __future__ import annotations

import dataclasses

from ember.data.config import DataConfig
from ember.launch.run_config import TrainConfig, register_config
from ember.models import get_config
from ember.optim.config import OptimConfig

__all__ = ["deepseek_v3_tiny", "dpo", "gpt2_tiny", "llama3_125m", "llama3_tiny", "mistral_tiny", "qwen2_tiny",
           "qwen3_moe_tiny", "sft", "tiny_chat_dpo", "tiny_chat_sft"]

_BYTE_VOCAB = 320  # 257 byte-tokenizer ids padded to a multiple of 64


@register_config("llama3_tiny")
def llama3_tiny() -> TrainConfig:
    """~1.6M-parameter Llama (4 layers, d=192, GQA 6:2) on the stdlib corpus: the default run."""
    model = get_config("llama3", "tiny").replace(
        vocab_size=_BYTE_VOCAB, n_layers=4, d_model=192, n_heads=6, n_kv_heads=2, ffn_dim=512
    )
    return TrainConfig(
        family="llama3",
        model=model,
        optim=OptimConfig(name="adamw", learning_rate=3e-3, warmup_steps=30, weight_decay=0.1),
        data=DataConfig(source="stdlib", seq_len=128, batch_size=16),
        steps=300,
        eval_every=100,
        out="runs/default",
    )


@register_config("gpt2_tiny")
def gpt2_tiny() -> TrainConfig:
    """The GPT-2 family's toy model on the same data and schedule."""
    base = llama3_tiny()
    return TrainConfig(
        family="gpt2",
        model=get_config("gpt2", "tiny").replace(vocab_size=_BYTE_VOCAB),
        optim=base.optim,
        data=base.data,
        steps=base.steps,
        eval_every=base.eval_every,
        out="runs/gpt2_tiny",
    )


def _llama_layout_tiny(family: str) -> TrainConfig:
    """`llama3_tiny`'s shapes, data and schedule for another Llama-layout family."""
    base = llama3_tiny()
    fields = {k: getattr(base.model, k) for k in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim")}
    return dataclasses.replace(base, family=family, model=get_config(family, "tiny").replace(**fields),
                               out=f"runs/{family}_tiny")


@register_config("qwen2_tiny")
def qwen2_tiny() -> TrainConfig:
    """The Qwen2 family's toy model (`llama3_tiny`'s shapes, with q/k/v biases) on the same data and schedule."""
    return _llama_layout_tiny("qwen2")


@register_config("mistral_tiny")
def mistral_tiny() -> TrainConfig:
    """The Mistral family's toy model (`llama3_tiny`'s shapes, a 64-token window) on the same data and schedule."""
    return _llama_layout_tiny("mistral")


@register_config("qwen3_moe_tiny")
def qwen3_moe_tiny() -> TrainConfig:
    """A Qwen3-MoE toy (`llama3_tiny`'s attention; 8 experts of width 128, top-2, dropless) on the same data."""
    base = _llama_layout_tiny("qwen3_moe")
    return dataclasses.replace(base, model=base.model.replace(moe_ffn_dim=128))


@register_config("deepseek_v3_tiny")
def deepseek_v3_tiny() -> TrainConfig:
    """A DeepSeek-V3 toy (latent attention, a dense first layer, then 8 experts in 4 groups, top-2, one shared,
    dropless) at `llama3_tiny`'s width on the same data and schedule."""
    base = llama3_tiny()
    model = get_config("deepseek_v3", "tiny").replace(vocab_size=_BYTE_VOCAB, n_layers=4, d_model=192, n_heads=6,
                                                      n_kv_heads=6, ffn_dim=512, moe_ffn_dim=128)
    return dataclasses.replace(base, family="deepseek_v3", model=model, out="runs/deepseek_v3_tiny")


@register_config("tiny_chat_sft")
def tiny_chat_sft() -> TrainConfig:
    """Supervised fine-tuning of the Hugging Face folder `launch/tiny_chat.py` writes, on its chat JSONL."""
    base, folder = qwen2_tiny(), "runs/tiny_chat/model"
    data = DataConfig(source="sft", path="runs/tiny_chat/chat.jsonl", tokenizer="model", tokenizer_path=folder,
                      seq_len=256, batch_size=4)
    return dataclasses.replace(base, init_from=folder, data=data, steps=150, eval_every=50, eval_batches=4,
                               optim=dataclasses.replace(base.optim, warmup_steps=10),
                               sample_prompt="What is the json module for?", sample_tokens=40,
                               out="runs/tiny_chat_sft")


@register_config("sft")
def sft() -> TrainConfig:
    """SFT of any native family's folder: --init_from FOLDER (its config.json is the model), --data.path FILE.jsonl."""
    data = DataConfig(source="sft", tokenizer="model", seq_len=256, batch_size=4)  # the tokenizer of --init_from
    return TrainConfig(family="", model=None, data=data, steps=150, eval_every=50, eval_batches=4, checkpoint_every=0,
                       optim=OptimConfig(name="adamw", learning_rate=2e-5, warmup_steps=10, weight_decay=0.0),
                       sample_prompt="Hello! Who are you?", sample_tokens=40, out="runs/sft")


@register_config("dpo")
def dpo() -> TrainConfig:
    """DPO (or --dpo.loss ipo, simpo, orpo, ...) of any native family's folder: --init_from FOLDER --data.path PAIRS.jsonl."""
    data = DataConfig(source="preference", tokenizer="model", seq_len=256, batch_size=4)  # pairs per step
    return TrainConfig(family="", model=None, data=data, steps=100, eval_every=50, eval_batches=4, checkpoint_every=0,
                       optim=OptimConfig(name="adamw", learning_rate=1e-6, warmup_steps=10, weight_decay=0.0),
                       sample_prompt="Hello! Who are you?", sample_tokens=40, out="runs/dpo")


@register_config("tiny_chat_dpo")
def tiny_chat_dpo() -> TrainConfig:
    """DPO of the `launch/tiny_chat.py` folder on its pairs (an answer against its words reversed)."""
    base, folder = dpo(), "runs/tiny_chat/model"
    data = dataclasses.replace(base.data, path="runs/tiny_chat/prefs.jsonl", tokenizer_path=folder, seq_len=128)
    return dataclasses.replace(base, family="qwen2", model=qwen2_tiny().model, init_from=folder, data=data, steps=60,
                               eval_every=20, optim=dataclasses.replace(base.optim, learning_rate=1e-4, warmup_steps=5),
                               sample_prompt="What is the json module for?", out="runs/tiny_chat_dpo")


@register_config("llama3_125m")
def llama3_125m() -> TrainConfig:
    """The 125M-class Llama used by the benchmarks (~129.0M-parameter; BPE tokenizer, 1024-token windows)."""
    return TrainConfig(
        family="llama3",
        model=get_config("llama3", "125m"),
        optim=OptimConfig(name="adamw", learning_rate=6e-4, warmup_steps=100),
        data=DataConfig(source="stdlib", tokenizer="bpe", vocab_size=32768, seq_len=1024, batch_size=8, max_bytes=None),
        steps=1000,
        out="runs/llama3_125m",
    )
