"""`ember.models.hf`: Hugging Face GPT-2 / Llama checkpoints in and out, with transformers as the oracle.

Everything is local: tiny random `transformers` models are saved with `save_pretrained` into a
temporary folder, imported with `from_hf`, compared on logits (fp32, max abs diff < 1e-4; measured
~2e-7), exported with `to_hf` and compared tensor by tensor (`torch.equal`) and reloaded with
`transformers.AutoModelForCausalLM`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.core import pytree, random
from ember.models import GPT2, GPT2Config, Llama3, Llama3Config
from ember.models.hf import config_from_hf, config_to_hf, from_hf, params_from_hf, params_to_hf, to_hf
from ember.models.layers import RopeScaling, YarnScaling

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # fp32 logits; HF and ember order the same float ops slightly differently (measured <= 4e-7)

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # short original context so most of head_dim=16's frequencies are actually rescaled
    "original_max_position_embeddings": 16,
}

YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0}
"""YaRN (DeepSeek-V3, Qwen long context) with its attention factor on cos and sin (1.139 at factor 4)."""

LLAMA_CASES = [  # (id, tie_word_embeddings, rope_scaling)
    ("untied-llama3rope", False, LLAMA3_SCALING),
    ("untied-yarn", False, YARN_SCALING),
    ("tied-defaultrope", True, None),
]


def _hf_gpt2(attn: str = "eager"):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64, attn_implementation=attn,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


def _hf_llama(tie: bool, rope_scaling, attn: str = "eager"):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, rope_scaling=rope_scaling, attn_implementation=attn,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _save(hf_model, path, **kw) -> str:
    hf_model.save_pretrained(str(path), safe_serialization=True, **kw)
    return str(path)


def _ids(n: int = 40, vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(2))


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(input_ids=ids, use_cache=False).logits


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def _assert_files_equal(dir_a, dir_b):
    a, b = load_file(os.path.join(dir_a, "model.safetensors")), load_file(os.path.join(dir_b, "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), f"tensor {k} differs after the round trip"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return _save(_hf_gpt2(), tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module", params=LLAMA_CASES, ids=[c[0] for c in LLAMA_CASES])
def llama_case(request, tmp_path_factory):
    _, tie, scaling = request.param
    hf = _hf_llama(tie, scaling)
    return hf, _save(hf, tmp_path_factory.mktemp("llama"))


# ---- GPT-2 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_logits_match_transformers(attn, tmp_path):
    hf = _hf_gpt2(attn)
    model, params = from_hf(_save(hf, tmp_path))
    assert isinstance(model, GPT2)
    c = model.config
    assert (c.vocab_size, c.max_seq_len, c.n_layers, c.n_heads, c.d_model, c.activation) == (300, 64, 2, 4, 64, "gelu_tanh")
    ids = _ids()
    assert _max_diff(model.apply(params, ids), _hf_logits(hf, ids)) < TOL


def test_gpt2_export_is_exact_and_reloads(gpt2_dir, tmp_path):
    model, params = from_hf(gpt2_dir)
    to_hf(model, params, tmp_path)
    _assert_files_equal(gpt2_dir, tmp_path)
    hf = _hf_gpt2()
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: not saved
    exported = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert sorted(state) == sorted(exported) and all(torch.equal(state[k], exported[k]) for k in state)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids = _ids()
    assert _max_diff(_hf_logits(reloaded, ids), _hf_logits(hf, ids)) == 0.0
    assert _max_diff(_hf_logits(reloaded, ids), model.apply(params, ids)) < TOL


def test_gpt2_hub_layout_without_prefix_and_mask_buffers(gpt2_dir):
    """The hub's `gpt2` weights have no `transformer.` prefix and carry `h.i.attn.bias` mask buffers."""
    state = {k.removeprefix("transformer."): v for k, v in load_file(os.path.join(gpt2_dir, "model.safetensors")).items()}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    state["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    cfg = config_from_hf(json.load(open(os.path.join(gpt2_dir, "config.json"))))
    _, ref = from_hf(gpt2_dir)
    pytree.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), params_from_hf(state, cfg), ref)


def test_ember_gpt2_without_biases_exports_zero_biases(tmp_path):
    model = GPT2(GPT2Config(vocab_size=300, max_seq_len=32, n_layers=2, n_heads=4, d_model=32, bias=False))
    params = model.init(random.key(0))
    to_hf(model, params, tmp_path, extra_config={"bos_token_id": 0, "eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids = _ids(16)
    assert _max_diff(model.apply(params, ids), _hf_logits(hf, ids)) < TOL


# ---- Llama -----------------------------------------------------------------------------------


def test_llama_logits_match_transformers(llama_case):
    hf, path = llama_case
    model, params = from_hf(path)
    assert isinstance(model, Llama3)
    c = model.config
    assert (c.n_heads, c.n_kv_heads, c.ffn_dim, c.norm_eps) == (4, 2, 128, 1e-6)
    assert c.tie_embeddings == hf.config.tie_word_embeddings and ("lm_head" in params) != c.tie_embeddings
    ids = _ids(48)  # past original_max_position_embeddings=16, where llama3 scaling matters
    got = model.apply(params, ids)
    assert _max_diff(got, _hf_logits(hf, ids)) < TOL
    if c.rope_scaling is not None:  # the scaling is not vacuous: without it the logits differ
        assert c.rope_scaling in (RopeScaling(factor=8.0, original_max_seq_len=16),
                                  YarnScaling(factor=4.0, original_max_seq_len=16, beta_fast=8.0))
        plain = Llama3(c.replace(rope_scaling=None))
        assert _max_diff(plain.apply(params, ids), got) > 1e-3


def test_llama_export_is_exact_and_reloads(llama_case, tmp_path):
    hf, path = llama_case
    model, params = from_hf(path)
    to_hf(model, params, tmp_path)
    _assert_files_equal(path, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert reloaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = _ids(48)
    assert _max_diff(_hf_logits(reloaded, ids), _hf_logits(hf, ids)) == 0.0


def test_ember_llama_exports_to_transformers(tmp_path):
    cfg = Llama3Config(vocab_size=300, max_seq_len=64, n_layers=2, n_heads=4, n_kv_heads=1, d_model=32,
                       ffn_dim=64, rope_scaling=RopeScaling(factor=4.0, original_max_seq_len=16))
    model = Llama3(cfg)
    params = model.init(random.key(3))
    to_hf(model, params, tmp_path, extra_config={"bos_token_id": 0, "eos_token_id": 0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="sdpa").eval()
    ids = _ids(40)
    assert _max_diff(model.apply(params, ids), _hf_logits(hf, ids)) < TOL
    back_model, back = from_hf(tmp_path)
    assert back_model.config == cfg
    pytree.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), back, params)


# ---- layouts and files -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_scan_layers_round_trip(family, gpt2_dir, tmp_path):
    if family == "gpt2":
        path, hf = gpt2_dir, None
    else:
        hf = _hf_llama(False, LLAMA3_SCALING)
        path = _save(hf, tmp_path / "src")
    model, params = from_hf(path, scan_layers=False)
    smodel, sparams = from_hf(path)
    assert smodel.config.scan_layers and not model.config.scan_layers
    for p, leaf in pytree.tree_leaves_with_path(sparams["blocks"]):
        assert leaf.shape[0] == 2, p  # (L, ...)
    ids = _ids(32)
    assert _max_diff(smodel.apply(sparams, ids), model.apply(params, ids)) < 1e-5
    to_hf(smodel, sparams, tmp_path / "out")
    _assert_files_equal(path, tmp_path / "out")
    assert params_to_hf(sparams, smodel.config).keys() == params_to_hf(params, model.config).keys()


def test_sharded_checkpoint(tmp_path):
    hf = _hf_llama(True, None)
    path = _save(hf, tmp_path, max_shard_size="40KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    model, params = from_hf(path)
    ids = _ids(24)
    assert _max_diff(model.apply(params, ids), _hf_logits(hf, ids)) < TOL


def test_dtype_override(gpt2_dir):
    _, params = from_hf(gpt2_dir, dtype=torch.bfloat16)
    assert {t.dtype for t in pytree.tree_leaves(params)} == {torch.bfloat16}


def test_config_mapping_both_rope_formats():
    v4 = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 5e5,
          "rope_scaling": {"type": "llama3", "factor": 32.0, "original_max_position_embeddings": 8192}}
    v5 = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                              "original_max_position_embeddings": 8192}}
    assert config_from_hf(v4) == config_from_hf(v5)
    assert config_from_hf(v4).rope_scaling == RopeScaling(factor=32.0)
    cfg = Llama3Config(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)
    assert config_from_hf(config_to_hf(cfg)) == cfg
    gcfg = GPT2Config(n_layers=2, d_model=64, n_heads=4, vocab_size=100, ffn_dim=96, activation="gelu", dropout=0.1)
    assert config_from_hf(config_to_hf(gcfg)) == gcfg
    assert config_from_hf(config_to_hf(gcfg), scan_layers=True, dropout=0.0) == gcfg.replace(scan_layers=True, dropout=0.0)


# ---- errors ----------------------------------------------------------------------------------


def _rewrite(path, *, config=None, state=None):
    if config is not None:
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump(config, fh)
    if state is not None:
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _copy(src, dst):
    os.makedirs(dst, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    state = load_file(os.path.join(src, "model.safetensors"))
    _rewrite(dst, config=cfg, state=state)
    return cfg, state


ERROR_CASES = [  # (id, edit(cfg, state) -> (cfg, state), exception, match)
    ("unknown-architecture", lambda c, s: ({**c, "model_type": "madeup", "architectures": ["MadeUpForCausalLM"]}, s),
     ValueError, r"'madeup' has no native ember family \(deepseek_v3 \(DeepseekV3ForCausalLM\), dots1 \(Dots1ForCausalLM\), gemma \(GemmaForCausalLM\), "
                 r"gpt2 \(GPT2LMHeadModel\), llama \(LlamaForCausalLM\), mistral \(MistralForCausalLM\), "
                 r"mixtral \(MixtralForCausalLM\), qwen2 \(Qwen2ForCausalLM\), qwen3 \(Qwen3ForCausalLM\) and qwen3_moe \(Qwen3MoeForCausalLM\) do\), "
                 r"and transformers could not load .* model type `madeup`"),
    ("other-head", lambda c, s: ({**c, "architectures": ["GPT2ForSequenceClassification"]}, s),
     ValueError, r"GPT2ForSequenceClassification.*not supported"),
    ("missing", lambda c, s: (c, {k: v for k, v in s.items() if "h.1.mlp" not in k}),
     ValueError, r"missing 4 tensor\(s\), e\.g\. \['transformer\.h\.1\.mlp\.c_fc\.weight'"),
    ("unexpected", lambda c, s: (c, {**s, "transformer.h.0.extra.weight": torch.zeros(2)}),
     ValueError, r"1 unexpected tensor\(s\), e\.g\. \['transformer\.h\.0\.extra\.weight'\]"),
    ("shape", lambda c, s: ({**c, "n_positions": 32}, s),
     ValueError, r"'transformer\.wpe\.weight' has shape \(64, 64\), expected \(32, 64\)"),
    ("activation", lambda c, s: ({**c, "activation_function": "relu"}, s),
     ValueError, r"activation_function='relu' is not supported.*gelu_new"),
    ("dropouts", lambda c, s: ({**c, "attn_pdrop": 0.0}, s), ValueError, r"different dropout rates.*dropout=0\.0"),
    ("untied-head", lambda c, s: (c, {**s, "lm_head.weight": torch.zeros_like(s["transformer.wte.weight"])}),
     ValueError, r"lm_head\.weight differs"),
]


@pytest.mark.parametrize("edit,exc,match", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_from_hf_errors(edit, exc, match, gpt2_dir, tmp_path):
    cfg, state = _copy(gpt2_dir, tmp_path)
    cfg, state = edit(cfg, state)
    _rewrite(tmp_path, config=cfg, state=state)
    with pytest.raises(exc, match=match):
        from_hf(tmp_path)


def test_llama_unsupported_settings():
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(ValueError, match=r"attention_bias=True.*attention_bias=False"):
        config_from_hf({**base, "attention_bias": True})
    with pytest.raises(ValueError, match=r"rope type 'longrope' is not supported.*'default', 'llama3' .* and 'yarn'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    assert config_from_hf({**base, "head_dim": 32}).head_dim == 32  # a head width of its own (Qwen3, Gemma)
    with pytest.raises(ValueError, match=r"no field 'scan_layer'; did you mean 'scan_layers'"):
        config_from_hf(base, scan_layer=True)


def test_missing_files_and_bad_model(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json not found"):
        from_hf(tmp_path)
    _rewrite(tmp_path, config=config_to_hf(GPT2Config(n_layers=1, d_model=32, n_heads=4, vocab_size=50)))
    with pytest.raises(ValueError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        from_hf(tmp_path)
    with pytest.raises(TypeError, match=r"to_hf exports ember DeepseekV3, Dots1, Gemma, GPT2, Llama3, Mistral, Mixtral, Qwen2, Qwen3 and Qwen3Moe models"):
        to_hf(object(), {}, tmp_path)
    model = GPT2(GPT2Config(n_layers=1, d_model=32, n_heads=4, vocab_size=50, max_seq_len=8))
    params = model.init(random.key(0))
    params["wte"]["weight"] = torch.zeros(49, 32)
    with pytest.raises(ValueError, match=r"parameter 'wte\.weight' has shape \(49, 32\), expected \(50, 32\)"):
        to_hf(model, params, tmp_path)
