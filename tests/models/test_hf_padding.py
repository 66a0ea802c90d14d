"""Hugging Face `pad_token_id` as the embedding's `padding_idx`, and the config.json settings ember refuses.

transformers builds the Llama, Qwen2, Qwen3, Mistral and Gemma embeddings as `nn.Embedding(V, d, padding_idx=
pad_token_id)` (GPT-2's without one): the pad row gets no gradient from the lookup, while a tied output projection
still trains it. Everything is local (tiny random models saved with `save_pretrained`); the oracle is transformers
+ `torch.optim.AdamW` on the same weights and batches.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from ember import optim
from ember.core import TrainState, jit, random
from ember.core.step_fns import train_step
from ember.models import Llama3Config, build_model, lm_loss
from ember.models.hf import config_from_hf, from_hf, params_to_hf, to_hf
from ember.models.layers import Embedding

from test_hf import _save

transformers = pytest.importorskip("transformers")

V, STEPS, LR, WD = 300, 5, 1e-3, 0.01
# fp32, per step: the loss and every parameter. Measured: losses <= 9.5e-7; params <= 3.6e-5, all of it from
# Adam's first step on near-zero gradients, where g / (|g| + eps) magnifies rounding (eps=1e-5: <= 5.7e-6).
TOL = 1e-4

FAMILIES = [  # (id, HF config class, HF model class, pad_token_id, extra HF config)
    ("gemma-pad0", "GemmaConfig", "GemmaForCausalLM", 0, dict(head_dim=24, hidden_activation="gelu_pytorch_tanh")),
    ("llama-tied-pad7", "LlamaConfig", "LlamaForCausalLM", 7, dict(tie_word_embeddings=True)),
    ("qwen2-untied-pad299", "Qwen2Config", "Qwen2ForCausalLM", 299, dict(tie_word_embeddings=False)),
    ("qwen3-tied-pad0", "Qwen3Config", "Qwen3ForCausalLM", 0, dict(tie_word_embeddings=True, head_dim=24)),
    ("mistral-untied-pad3", "MistralConfig", "MistralForCausalLM", 3, dict(sliding_window=None)),
]


def _hf_model(cfg_cls: str, model_cls: str, pad, **extra):
    torch.manual_seed(5)
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager",
        bos_token_id=1, eos_token_id=1, pad_token_id=pad, **extra)
    return getattr(transformers, model_cls)(cfg)


def _hf_gpt2(pad, **extra):
    torch.manual_seed(5)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", pad_token_id=pad,
                                  bos_token_id=1, eos_token_id=1, **extra)
    return transformers.GPT2LMHeadModel(cfg)


def _batches(pad: int, n: int = STEPS):
    """Right-padded rows plus scattered pads, so the pad row is looked up in every batch."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (2, 25), generator=g)
        ids[0, -6:] = pad % V
        ids[1, torch.randint(0, 25, (4,), generator=g)] = pad % V
        out.append({"inputs": ids[:, :-1], "targets": ids[:, 1:]})
    return out


def _train_both(hf, path, batches, **overrides):
    """(loss diff, max param diff) after each of the steps: ember from the folder vs transformers in place."""
    model, params = from_hf(path, **overrides)
    step = train_step(lm_loss(model), optim.adamw(LR, weight_decay=WD))
    state = TrainState.create(params=params, tx=optim.adamw(LR, weight_decay=WD), key=random.key(0))
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=WD)
    diffs = []
    for batch in batches:
        state, metrics = step(state, batch)
        logits = hf(input_ids=batch["inputs"], use_cache=False).logits  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, V), batch["targets"].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ours, theirs = params_to_hf(state.params, model.config), hf.state_dict()
        param_diff = max((t - theirs[k]).abs().max().item() for k, t in ours.items())
        diffs.append((abs(metrics["loss"].item() - loss.item()), param_diff))
    return model, diffs


@pytest.mark.parametrize("case", FAMILIES, ids=[c[0] for c in FAMILIES])
def test_five_adamw_steps_match_transformers(case, tmp_path):
    """Measured per step: loss diffs <= 9.5e-7, param diffs <= 3.6e-5 (Llama tied; Gemma, pad 0: 3.6e-6); training
    the pad row from the lookup, as ember did before, drifts Gemma by 1.5e-2 (loss) and 8.9e-3 (params) in 5 steps."""
    _, cfg_cls, model_cls, pad, extra = case
    hf = _hf_model(cfg_cls, model_cls, pad, **extra)
    assert hf.model.embed_tokens.padding_idx == pad % V  # transformers does pass pad_token_id to nn.Embedding
    model, diffs = _train_both(hf, _save(hf, tmp_path), _batches(pad))
    assert model.config.pad_token_id == pad
    assert max(max(d) for d in diffs) < TOL, diffs


def test_gemma_without_padding_idx_drifts(tmp_path):
    """The test above is sensitive: training the pad row from the lookup (pad_token_id=None) drifts."""
    _, cfg_cls, model_cls, pad, extra = FAMILIES[0]
    hf = _hf_model(cfg_cls, model_cls, pad, **extra)
    _, diffs = _train_both(hf, _save(hf, tmp_path), _batches(pad), pad_token_id=None)
    assert max(d[1] for d in diffs) > 1e-3, diffs


def test_gpt2_has_no_padding_idx_in_transformers_nor_in_ember(tmp_path):
    hf = _hf_gpt2(pad=0)
    assert hf.transformer.wte.padding_idx is None
    model, diffs = _train_both(hf, _save(hf, tmp_path), _batches(0))
    assert not hasattr(model.config, "pad_token_id")
    assert max(max(d) for d in diffs) < TOL, diffs


# ---- the pad row in ember: gradient, init, compile, default path --------------------------------


def _llama_pad(pad, **kw) -> Llama3Config:
    return Llama3Config(vocab_size=64, max_seq_len=32, n_layers=1, n_heads=2, n_kv_heads=1, d_model=16, ffn_dim=32,
                        tie_embeddings=False, pad_token_id=pad, **kw)


@pytest.mark.parametrize("compiler", ["jit", "torch.compile"])  # ember's make_fx trace, a user's Dynamo
def test_pad_row_gets_no_lookup_gradient_eager_and_compiled(compiler):
    model = build_model("llama3", _llama_pad(5))
    params = model.init(random.key(0))
    assert params["wte"]["weight"][5].abs().sum() == 0  # starts at zero, as torch.nn.Embedding's padding_idx row
    ids = torch.tensor([[5, 1, 2, 5, 3, 5, 4, 6]])
    batch = {"inputs": ids, "targets": ids.roll(-1, 1)}

    def grads(p, b):
        return torch.func.grad(lambda q: lm_loss(model)(q, b, key=None).mean())(p)

    eager = grads(params, batch)
    compiled = (jit(grads) if compiler == "jit" else torch.compile(grads, fullgraph=True))(params, batch)
    for g in (eager, compiled):
        row = g["wte"]["weight"]
        assert torch.equal(row[5], torch.zeros(16)) and row[1].abs().sum() > 0
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    free = build_model("llama3", _llama_pad(None))  # the same params, every row trains
    g_free = torch.func.grad(lambda q: lm_loss(free)(q, batch, key=None).mean())(params)
    assert g_free["wte"]["weight"][5].abs().sum() > 0


def test_default_embedding_traces_to_the_plain_lookup():
    """No pad id, no extra op: the default path's forward and backward graph is `F.embedding`'s alone."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def graph_ops(fn):
        w, ids = torch.randn(10, 4), torch.tensor([[1, 0, 3]])
        gm = make_fx(torch.func.grad(lambda w: fn(w, ids).square().sum()))(w)
        return sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")

    plain = graph_ops(lambda w, ids: F.embedding(ids, w))
    assert graph_ops(lambda w, ids: Embedding(10, 4).apply({"weight": w}, ids)) == plain
    padded = graph_ops(lambda w, ids: Embedding(10, 4, padding_idx=0).apply({"weight": w}, ids))
    assert len(padded) > len(plain)  # eq + where on the pad positions, only when a pad id is set


def test_padding_idx_matches_torch_nn_embedding():
    w, ids = torch.randn(10, 4), torch.tensor([[1, 9, 3, 9]])
    ref = torch.nn.Embedding(10, 4, padding_idx=-1)
    ref.weight.data.copy_(w)
    ref(ids).square().sum().backward()
    ours = torch.func.grad(lambda w: Embedding(10, 4, padding_idx=-1).apply({"weight": w}, ids).square().sum())(w)
    assert torch.equal(ours, ref.weight.grad)
    with pytest.raises(ValueError, match=r"padding_idx must be None or an int in \[-10, 10\), got 10"):
        Embedding(10, 4, padding_idx=10)
    with pytest.raises(ValueError, match=r"pad_token_id must be None or a token id in \[-64, 64\).*got 64"):
        _llama_pad(64)


# ---- config.json: read, written back, refused ------------------------------------------------


def test_pad_token_id_round_trips_through_config_json(tmp_path):
    _, cfg_cls, model_cls, pad, extra = FAMILIES[0]
    model, params = from_hf(_save(_hf_model(cfg_cls, model_cls, pad, **extra), tmp_path / "src"))
    assert model.config.pad_token_id == 0
    to_hf(model, params, tmp_path / "out")
    assert json.load(open(os.path.join(tmp_path / "out", "config.json")))["pad_token_id"] == 0
    none = model.__class__(model.config.replace(pad_token_id=None))
    to_hf(none, params, tmp_path / "none")  # written as null: transformers' Gemma would otherwise default to 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "none"))
    assert reloaded.model.embed_tokens.padding_idx is None and from_hf(tmp_path / "none")[0].config.pad_token_id is None
    with pytest.raises(ValueError, match=r"extra_config sets pad_token_id=0, but the model's config writes "
                                         r"pad_token_id=None.*config\.replace"):
        to_hf(none, params, tmp_path / "clash", extra_config={"pad_token_id": 0})
    to_hf(none, params, tmp_path / "described", extra_config={"max_position_embeddings": 64, "bos_token_id": 2})
    assert json.load(open(os.path.join(tmp_path / "described", "config.json")))["max_position_embeddings"] == 64


DEFAULTS = [("llama", "LlamaConfig"), ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config"), ("mistral", "MistralConfig"),
            ("gemma", "GemmaConfig")]


@pytest.mark.parametrize("model_type,cfg_cls", DEFAULTS, ids=[c[0] for c in DEFAULTS])
def test_keys_config_json_leaves_out_read_as_transformers_defaults(model_type, cfg_cls):
    ours, hf = config_from_hf({"model_type": model_type}), getattr(transformers, cfg_cls)()
    theirs = dict(vocab_size=hf.vocab_size, d_model=hf.hidden_size, ffn_dim=hf.intermediate_size,
                  n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads,
                  head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                  max_seq_len=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps,
                  rope_theta=getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"],  # 4.x or 5.x
                  tie_embeddings=hf.tie_word_embeddings,
                  pad_token_id=hf.pad_token_id, sliding_window=getattr(hf, "sliding_window", None),
                  init_std=hf.initializer_range)
    assert {k: getattr(ours, k) for k in theirs} == theirs


_BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "num_hidden_layers": 2, "vocab_size": V}
REFUSED = [  # (id, model_type, config.json entries transformers honours and ember does not, message)
    ("attention_dropout", "llama", {"attention_dropout": 0.1}, r"attention_dropout=0\.1.*Llama3 \(no attention dropout\)"),
    ("attention_dropout-gemma", "gemma", {"attention_dropout": 0.1}, r"attention_dropout=0\.1.*Gemma"),
    ("rope-dynamic", "qwen2", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, r"rope type 'dynamic'"),
    ("attention_bias", "llama", {"attention_bias": True}, r"attention_bias=True.*attention_bias=False"),
    ("attention_bias-qwen3", "qwen3", {"attention_bias": True}, r"attention_bias=True"),
    ("attention_bias-gemma", "gemma", {"attention_bias": True}, r"attention_bias=True"),
    ("mlp_bias", "llama", {"mlp_bias": True}, r"mlp_bias=True.*mlp_bias=False"),
    ("hidden_act", "mistral", {"hidden_act": "gelu"}, r"hidden_act='gelu'.*Mistral \(SwiGLU\)"),
    ("hidden_act-gemma", "gemma", {"hidden_act": "relu", "hidden_activation": "gelu_pytorch_tanh"},
     r"hidden_act='relu'.*gelu_pytorch_tanh"),
    ("layer_types", "qwen2", {"layer_types": ["sliding_attention", "full_attention"]},
     r"layer_types with \['full_attention', 'sliding_attention'\].*Qwen2 needs every entry 'full_attention'"),
    ("layer_types-qwen3", "qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, r"Qwen3 needs every"),
    ("use_sliding_window", "qwen2", {"use_sliding_window": True}, r"use_sliding_window=True"),
    ("bidirectional", "gemma", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=True.*causal"),
    ("untied-gemma", "gemma", {"tie_word_embeddings": False}, r"tie_word_embeddings=False"),
    ("pad-outside-vocab", "llama", {"pad_token_id": V}, r"pad_token_id must be None or a token id in \[-300, 300\)"),
    ("gpt2-inverse-layer-scale", "gpt2", {"scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx"),
    ("gpt2-cross-attention", "gpt2", {"add_cross_attention": True}, r"add_cross_attention=True"),
]


@pytest.mark.parametrize("model_type,entries,match", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_settings_ember_does_not_implement_are_refused(model_type, entries, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({"model_type": model_type, **_BASE, **entries})


CHANGES_THE_MATH = [  # (id, HF config class, HF model class, entries, attn_implementation, training)
    ("attention_dropout", "LlamaConfig", "LlamaForCausalLM", {"attention_dropout": 0.5}, "eager", True),
    ("layer_types", "Qwen2Config", "Qwen2ForCausalLM",
     {"layer_types": ["sliding_attention"] * 2, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
     "eager", False),
    # only where transformers hands causality to the kernel (sdpa, its default); its eager path stays causal
    ("bidirectional", "GemmaConfig", "GemmaForCausalLM", {"use_bidirectional_attention": True, "head_dim": 16}, "sdpa",
     False),
]


@pytest.mark.parametrize("cfg_cls,model_cls,entries,attn,training", [c[1:] for c in CHANGES_THE_MATH],
                         ids=[c[0] for c in CHANGES_THE_MATH])
def test_refused_settings_change_transformers_logits(cfg_cls, model_cls, entries, attn, training):
    """Keeps the refusals honest: each one changes what transformers computes (biases need no proof)."""
    ids = _batches(0, 1)[0]["inputs"]
    plain_extra = {k: v for k, v in entries.items() if k == "head_dim"}
    with torch.no_grad():
        plain = _hf_model(cfg_cls, model_cls, None, **plain_extra).train(training)(input_ids=ids).logits
        hf = _hf_model(cfg_cls, model_cls, None, **entries)
        hf.config._attn_implementation = attn
        changed = hf.train(training)(input_ids=ids).logits
    assert (plain - changed).abs().max() > 1e-3
    with pytest.raises(ValueError, match="|".join(k for k in entries if k != "head_dim")):
        config_from_hf(hf.config.to_dict())


IGNORED = [  # (id, HF config class, HF model class, entries): read by transformers, yet its fp32 logits do not move
    ("partial_rotary_factor", "LlamaConfig", "LlamaForCausalLM", {"partial_rotary_factor": 0.5}),  # default RoPE
    ("pretraining_tp", "LlamaConfig", "LlamaForCausalLM", {"pretraining_tp": 2}),  # 4.x: a split of the same matmuls
    ("reorder_and_upcast_attn", "GPT2Config", "GPT2LMHeadModel", {"reorder_and_upcast_attn": True}),  # precision only
]


@pytest.mark.parametrize("cfg_cls,model_cls,entries", [c[1:] for c in IGNORED], ids=[c[0] for c in IGNORED])
def test_ignored_settings_leave_transformers_logits_alone(cfg_cls, model_cls, entries):
    ids = _batches(0, 1)[0]["inputs"]
    build = (lambda **kw: _hf_gpt2(None, **kw)) if cfg_cls == "GPT2Config" else (
        lambda **kw: _hf_model(cfg_cls, model_cls, None, **kw))
    with torch.no_grad():
        plain, ignored = build().eval()(input_ids=ids).logits, build(**entries).eval()
        assert torch.equal(plain, ignored(input_ids=ids).logits)
    config_from_hf(ignored.config.to_dict())  # accepted
