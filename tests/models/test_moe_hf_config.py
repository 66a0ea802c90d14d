"""Qwen3-MoE, dots1, Mixtral and DeepSeek-V3 config.json in ember: the keys read (released configs give the named architectures,
missing keys read as transformers' defaults), the settings refused, exports of what only ember's configs
say (first dense layers, no bias, no shared experts), and `--init_from` with such a folder."""

from __future__ import annotations

import pytest
import torch

from ember.core import pytree, random
from ember.core.checkpoint import model_info
from ember.launch import build
from ember.launch.init_from import load_initial_params
from ember.launch.run_config import parse_cli
from ember.models import build_model, count_active_params, count_params, get_config, to_hf
from ember.models.hf import config_from_hf, config_to_hf

from test_hf import TOL, _hf_logits, _max_diff
from test_moe_hf import _hf_model, _ids

transformers = pytest.importorskip("transformers")

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json, its math entries
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}
DOTS_LLM1 = {  # rednote-hilab/dots.llm1.inst config.json, its math entries (n_group / topk_group are null there)
    "model_type": "dots1", "architectures": ["Dots1ForCausalLM"], "attention_bias": False, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 32768,
    "moe_intermediate_size": 1408, "n_group": None, "n_routed_experts": 128, "n_shared_experts": 2,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 62,
    "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "rope_theta": 10000000, "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False, "topk_group": None, "vocab_size": 152064,
}

MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1 config.json, its math entries
    "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
}
MIXTRAL_8X22B = {**MIXTRAL_8X7B, "hidden_size": 6144, "intermediate_size": 16384, "max_position_embeddings": 65536,
                 "num_attention_heads": 48, "num_hidden_layers": 56, "router_aux_loss_coef": 0.001,
                 "vocab_size": 32768}  # mistralai/Mixtral-8x22B-v0.1
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json, its math entries (and keys transformers ignores)
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "v_head_dim": 128, "vocab_size": 129280,
}
KIMI_K2 = {**DEEPSEEK_V3, "first_k_dense_replace": 1, "max_position_embeddings": 131072, "n_group": 1,
           "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64, "rope_theta": 50000.0,
           "routed_scaling_factor": 2.827, "topk_group": 1, "vocab_size": 163840,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"}}
"""moonshotai/Kimi-K2-Instruct (July 2025) config.json's math entries; its own model_type is "kimi_k2" (remote code)."""


def test_released_configs_are_the_named_architectures():
    assert config_from_hf(QWEN3_30B_A3B) == get_config("qwen3_moe", "30b-a3b")
    assert config_from_hf(DOTS_LLM1) == get_config("dots1", "142b-a14b")
    assert config_from_hf(MIXTRAL_8X7B) == get_config("mixtral", "8x7b")
    assert config_from_hf(MIXTRAL_8X22B) == get_config("mixtral", "8x22b")
    assert config_from_hf({**QWEN3_30B_A3B, "num_experts": None, "num_local_experts": 128}).n_experts == 128  # 5.x
    assert config_from_hf(DEEPSEEK_V3) == get_config("deepseek_v3", "671b-a37b")
    assert config_from_hf(KIMI_K2) == get_config("deepseek_v3", "1t-a32b")


def test_released_sizes_have_their_parameter_counts():
    """Total and active parameters (multi-token-prediction layers excluded, as the model cards count them)."""
    counts = {(f, a): (round(count_params(build_model(f, a)) / 1e9, 1), round(count_active_params(build_model(f, a)) / 1e9, 1))
              for f, a in [("deepseek_v3", "671b-a37b"), ("deepseek_v3", "1t-a32b"), ("mixtral", "8x7b"),
                           ("mixtral", "8x22b"), ("qwen3_moe", "30b-a3b"), ("qwen3_moe", "235b-a22b"),
                           ("dots1", "142b-a14b")]}
    assert counts == {("deepseek_v3", "671b-a37b"): (671.0, 37.6), ("deepseek_v3", "1t-a32b"): (1026.4, 32.9),
                      ("mixtral", "8x7b"): (46.7, 12.9), ("mixtral", "8x22b"): (140.6, 39.2),
                      ("qwen3_moe", "30b-a3b"): (30.5, 3.4), ("qwen3_moe", "235b-a22b"): (235.1, 22.2),
                      ("dots1", "142b-a14b"): (142.8, 14.0)}


def test_deepseek_v3_export_writes_what_transformers_reads_back():
    hf = config_to_hf(get_config("deepseek_v3", "671b-a37b"))
    theirs = transformers.DeepseekV3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert (theirs.kv_lora_rank, theirs.q_lora_rank, theirs.qk_head_dim, theirs.v_head_dim) == (512, 1536, 192, 128)
    assert theirs.rope_parameters["rope_type"] == "yarn" and theirs.rope_parameters["factor"] == 40.0
    assert config_from_hf(hf) == get_config("deepseek_v3", "671b-a37b")


def test_yarn_frequencies_are_transformers():
    """DeepSeek-V3's YaRN (and one with an attention factor from mscale alone), element for element."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ember.models.layers import RotaryEmbedding, rope_frequencies

    for rope in (DEEPSEEK_V3["rope_scaling"], {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                              "mscale": 0.7}):
        c = config_from_hf({**DEEPSEEK_V3, "rope_scaling": rope, "max_position_embeddings": 256})
        hf = transformers.DeepseekV3Config(rope_parameters={**rope, "rope_type": "yarn", "rope_theta": 10000.0},
                                           max_position_embeddings=256)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        assert torch.equal(rope_frequencies(64, theta=10000.0, scaling=c.rope_scaling), inv_freq)
        cos, _ = RotaryEmbedding(64, scaling=c.rope_scaling).cos_sin(torch.tensor([0]))
        assert cos[0, 0].item() == pytest.approx(factor)


_DOTS1_REQUIRED = {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1}


@pytest.mark.parametrize("model_type,cfg_cls,entries", [("qwen3_moe", "Qwen3MoeConfig", {}),
                                                        ("dots1", "Dots1Config", _DOTS1_REQUIRED)])
def test_keys_config_json_leaves_out_read_as_transformers_defaults(model_type, cfg_cls, entries):
    ours, hf = config_from_hf({"model_type": model_type, **entries}), getattr(transformers, cfg_cls)(**entries)
    theirs = dict(vocab_size=hf.vocab_size, d_model=hf.hidden_size, ffn_dim=hf.intermediate_size,
                  n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads,
                  head_dim=hf.hidden_size // hf.num_attention_heads, max_seq_len=hf.max_position_embeddings,
                  norm_eps=hf.rms_norm_eps, rope_theta=hf.rope_parameters["rope_theta"],
                  tie_embeddings=hf.tie_word_embeddings, init_std=hf.initializer_range,
                  n_experts=hf.num_local_experts, experts_per_token=hf.num_experts_per_tok,
                  moe_ffn_dim=hf.moe_intermediate_size, norm_topk_prob=hf.norm_topk_prob)
    if model_type == "qwen3_moe":
        theirs.update(decoder_sparse_step=hf.decoder_sparse_step, mlp_only_layers=tuple(hf.mlp_only_layers),
                      router_aux_loss_coef=hf.router_aux_loss_coef)
    else:
        theirs.update(n_expert_groups=hf.n_group, topk_groups=hf.topk_group, n_shared_experts=hf.n_shared_experts,
                      routed_scaling_factor=hf.routed_scaling_factor, first_dense_layers=hf.first_k_dense_replace)
    assert {k: getattr(ours, k) for k in theirs} == theirs


_BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "moe_intermediate_size": 32, "num_hidden_layers": 2, "vocab_size": 300}
REFUSED = [  # (id, model_type, config.json entries transformers honours and ember does not, or that are wrong)
    ("hidden_act", "qwen3_moe", {"hidden_act": "gelu"}, r"hidden_act='gelu'.*Qwen3-MoE \(SwiGLU experts\)"),
    ("attention_bias", "qwen3_moe", {"attention_bias": True}, r"attention_bias=True.*attention_bias=False"),
    ("use_sliding_window", "qwen3_moe", {"use_sliding_window": True}, r"use_sliding_window=True"),
    ("attention_dropout", "qwen3_moe", {"attention_dropout": 0.1}, r"attention_dropout=0\.1.*Qwen3-MoE"),
    ("rope-longrope", "qwen3_moe", {"rope_parameters": {"rope_type": "longrope", "factor": 4.0}},
     r"rope type 'longrope'.*'default', 'llama3' .* and 'yarn'"),
    ("rope-yarn-attention_factor", "qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64, "attention_factor": 1.3}},
     r"attention_factor=1\.3; ember derives it .*remove it"),
    ("no-experts", "qwen3_moe", {"num_experts": 0}, r"num_experts=0: every layer is dense.*model_type 'qwen3'"),
    ("expert-counts-disagree", "qwen3_moe", {"num_experts": 8, "num_local_experts": 4},
     r"expert count twice, differently: \{'num_local_experts': 4, 'num_experts': 8\}"),
    ("mlp_only_layers-outside", "qwen3_moe", {"mlp_only_layers": [5]}, r"mlp_only_layers names layers \[5\]"),
    ("top-k-above-experts", "qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 6}, r"experts_per_token=6"),
    ("hidden_act-dots1", "dots1", {**_DOTS1_REQUIRED, "hidden_act": "relu"}, r"hidden_act='relu'.*dots1"),
    ("attention_bias-dots1", "dots1", {**_DOTS1_REQUIRED, "attention_bias": True}, r"attention_bias=True"),
    ("layer_types-dots1", "dots1", {**_DOTS1_REQUIRED, "layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types with \['full_attention', 'sliding_attention'\].*dots1 needs every entry 'full_attention'"),
    ("max_window_layers-dots1", "dots1", {**_DOTS1_REQUIRED, "sliding_window": 64, "max_window_layers": 1},
     r"layer_types with \['full_attention', 'sliding_attention'\]"),
    ("no-shared-count-dots1", "dots1", {"n_routed_experts": 8, "num_experts_per_tok": 2}, r"no n_shared_experts"),
    ("no-expert-count-dots1", "dots1", {"num_experts_per_tok": 2, "n_shared_experts": 1}, r"no n_routed_experts"),
    ("groups-dots1", "dots1", {**_DOTS1_REQUIRED, "n_group": 3}, r"n_expert_groups=3 must divide n_experts=8"),
    ("hidden_act-mixtral", "mixtral", {"hidden_act": "gelu"}, r"hidden_act='gelu'.*Mixtral \(SwiGLU experts\)"),
    ("router_jitter_noise-mixtral", "mixtral", {"router_jitter_noise": 0.1},
     r"router_jitter_noise=0\.1.*Mixtral \(a deterministic router, no jitter noise\) needs router_jitter_noise=0\.0"),
    ("attention_bias-deepseek_v3", "deepseek_v3", {"num_key_value_heads": 4, "attention_bias": True},
     r"attention_bias=True.*DeepSeek-V3 \(no attention biases\)"),
    ("kv-heads-deepseek_v3", "deepseek_v3", {}, r"num_key_value_heads=2 and num_attention_heads=4; latent attention "
                                                r"expands a key and value per head: set num_key_value_heads=4"),
    ("odd-rope-deepseek_v3", "deepseek_v3", {"num_key_value_heads": 4, "qk_rope_head_dim": 7},
     r"qk_rope_head_dim must be even"),
]


def test_mixtral_keys_config_json_leaves_out_read_as_transformers_defaults():
    ours, hf = config_from_hf({"model_type": "mixtral"}), transformers.MixtralConfig()
    theirs = dict(vocab_size=hf.vocab_size, d_model=hf.hidden_size, moe_ffn_dim=hf.intermediate_size,
                  n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads,
                  max_seq_len=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps,
                  rope_theta=hf.rope_parameters["rope_theta"], tie_embeddings=hf.tie_word_embeddings,
                  n_experts=hf.num_local_experts, experts_per_token=hf.num_experts_per_tok,
                  router_aux_loss_coef=hf.router_aux_loss_coef, sliding_window=hf.sliding_window)
    assert {k: getattr(ours, k) for k in theirs} == theirs


@pytest.mark.parametrize("model_type,entries,match", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_settings_ember_does_not_implement_are_refused(model_type, entries, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({"model_type": model_type, **_BASE, **entries})


@pytest.mark.parametrize("model_type,entries", [
    ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, use_sliding_window=True, sliding_window=4)),
    ("dots1", dict(n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, sliding_window=4,
                   layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
], ids=["qwen3_moe", "dots1"])
def test_refused_windows_change_transformers_logits(model_type, entries):
    """Keeps the window refusals honest: transformers does window these layers (eager attention, 40 tokens)."""
    windowless = {k: v for k, v in entries.items() if k not in ("use_sliding_window", "sliding_window", "layer_types")}
    ids = _ids(40)
    plain, windowed = _hf_model(model_type, windowless), _hf_model(model_type, entries)
    assert _max_diff(_hf_logits(plain, ids), _hf_logits(windowed, ids)) > 1e-3
    with pytest.raises(ValueError, match="use_sliding_window|layer_types"):
        config_from_hf(windowed.config.to_dict())


def test_configs_transformers_cannot_hold_are_refused_on_export():
    moe = get_config("qwen3_moe", "tiny")
    with pytest.raises(ValueError, match=r"routes by softmax top-k, got router='sigmoid'.*as the dots1 family"):
        config_to_hf(moe.replace(router="sigmoid"))
    with pytest.raises(ValueError, match=r"no shared experts, got n_shared_experts=1"):
        config_to_hf(moe.replace(n_shared_experts=1))
    with pytest.raises(ValueError, match=r"no q/k/v biases"):
        config_to_hf(moe.replace(qkv_bias=True))
    dots = get_config("dots1", "tiny")
    with pytest.raises(ValueError, match=r"sigmoid scores \(DeepSeek-V3\), got router='softmax'.*qwen3_moe family"):
        config_to_hf(dots.replace(router="softmax", expert_bias=False, n_expert_groups=1, topk_groups=1))
    with pytest.raises(ValueError, match=r"decoder_sparse_step=2 and mlp_only_layers beyond them \[2\]"):
        config_to_hf(dots.replace(decoder_sparse_step=2, mlp_only_layers=(2,)))
    assert config_to_hf(dots.replace(mlp_only_layers=(0,)))["first_k_dense_replace"] == 1  # already dense


EXPORTED = [  # (id, family, ember config changes): what only ember's config says, written so transformers agrees
    ("qwen3_moe-first-dense", "qwen3_moe", dict(n_layers=3, first_dense_layers=1, mlp_only_layers=(2,))),
    ("dots1-no-bias-no-shared", "dots1", dict(expert_bias=False, n_shared_experts=0)),
]


@pytest.mark.parametrize("family,changes", [c[1:] for c in EXPORTED], ids=[c[0] for c in EXPORTED])
def test_ember_only_settings_export_with_the_same_logits(family, changes, tmp_path):
    model = build_model(family, get_config(family, "tiny").replace(init_std=0.1, **changes))
    params = model.init(random.key(3))
    to_hf(model, params, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    ids = _ids(24) % model.config.vocab_size
    assert _max_diff(model.apply(params, ids), _hf_logits(hf, ids)) < TOL
    if family == "qwen3_moe":
        assert hf.config.mlp_only_layers == [0, 2]
    else:
        assert hf.model.layers[1].mlp.shared_experts.gate_proj.weight.shape == (0, 128)
        assert not hf.model.layers[1].mlp.gate.e_score_correction_bias.any()


# ---- --init_from ------------------------------------------------------------------------------


def test_a_run_starts_from_a_qwen3_moe_folder(tmp_path):
    cfg = parse_cli("qwen3_moe_tiny", [])
    model = build_model(cfg.family, cfg.model.replace(scan_layers=False))  # saved as a list of blocks
    saved = model.init(random.key(7))
    to_hf(model, saved, tmp_path)
    cfg = parse_cli("qwen3_moe_tiny", ["--init_from", str(tmp_path)])
    state = build.initial_state(cfg, build_model(cfg.family, cfg.model))
    assert int(state.step) == 0
    stacked = state.params["blocks"]["mlp"]["gate"]  # (layers, E, I, d): loaded into the scanned layout
    assert stacked.shape[:2] == (cfg.model.n_layers, cfg.model.n_experts)
    torch.testing.assert_close(stacked[1], saved["blocks"][1]["mlp"]["gate"], rtol=0, atol=0)
    torch.testing.assert_close(state.params["blocks"]["mlp"]["router"]["weight"][0],
                               saved["blocks"][0]["mlp"]["router"]["weight"], rtol=0, atol=0)
    cfg = parse_cli("qwen3_moe_tiny", ["--init_from", str(tmp_path), "--model.n_experts", "4"])
    with pytest.raises(ValueError, match=r"another qwen3_moe model than the run config: n_experts 8 there, 4 "
                                         r"configured.*--model\.n_experts 8"):
        build.initial_state(cfg, build_model(cfg.family, cfg.model))


def test_dots1_params_load_from_a_folder(tmp_path):
    config = get_config("dots1", "tiny")
    model = build_model("dots1", config)
    saved = pytree.tree_map_with_path(
        lambda p, t: torch.randn_like(t) if p.endswith("expert_bias") else t, model.init(random.key(1)))
    to_hf(model, saved, tmp_path)
    params = load_initial_params(str(tmp_path), model, model_info=model_info("dots1", config))
    pytree.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), params, saved)


def test_deepseek_v3_params_load_from_a_folder(tmp_path):
    """`--init_from` of a DeepSeek-V3 folder: interleaved rotary rows on disk, the same params back."""
    config = get_config("deepseek_v3", "tiny")
    model = build_model("deepseek_v3", config)
    saved = pytree.tree_map_with_path(
        lambda p, t: torch.randn_like(t) if p.endswith("expert_bias") else t, model.init(random.key(1)))
    to_hf(model, saved, tmp_path)
    params = load_initial_params(str(tmp_path), model, model_info=model_info("deepseek_v3", config))
    pytree.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), params, saved)
