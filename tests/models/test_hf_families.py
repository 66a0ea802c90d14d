"""Qwen2, Qwen3, Mistral and Gemma folders in and out of ember, and the bridge that takes any other causal LM,
with transformers as the oracle (tiny random models saved locally; fp32 logits, max abs diff < 1e-4)."""

from __future__ import annotations

import pytest
import torch

from ember.core import pytree, random
from ember.core.step_fns import train_step
from ember.models import Gemma, Mistral, MistralConfig, Qwen2, Qwen3, TorchModel, build_model, lm_loss
from ember.models.hf import config_from_hf, from_hf, to_hf
from ember import optim
from ember.core import TrainState

from test_hf import TOL, _assert_files_equal, _hf_logits, _ids, _max_diff, _save

transformers = pytest.importorskip("transformers")

SHAPES = [  # (id, heads, kv heads, tied)
    ("gqa-tied", 4, 2, True),
    ("mha-untied", 4, 4, False),
]


def _hf_model(family: str, heads: int, kv: int, tie: bool, **extra):
    torch.manual_seed(3)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=128,
                  rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie, attn_implementation="eager",
                  bos_token_id=0, eos_token_id=0, **extra)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    if family == "qwen3":  # a head width of its own (24, not 64 / heads), q/k norms that are not ones
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=24)).eval()
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
        return hf
    if family == "gemma":  # always tied; norm weights (the w of 1 + w) that are not zeros
        common.pop("tie_word_embeddings")
        hf = transformers.GemmaForCausalLM(transformers.GemmaConfig(**common, head_dim=24, tie_word_embeddings=True,
                                                                    hidden_activation="gelu_pytorch_tanh")).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
        return hf
    return transformers.MistralForCausalLM(transformers.MistralConfig(**common)).eval()


def _qwen2_with_biases(heads: int = 4, kv: int = 2, tie: bool = True):
    """A random Qwen2 whose q, k, v biases are not zero (their random init is), so they matter."""
    hf = _hf_model("qwen2", heads, kv, tie)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return hf


CASES = [(f, *shape) for f in ("qwen2", "qwen3", "mistral") for shape in SHAPES]
CASES += [("gemma", "gqa-tied", 4, 2, True), ("gemma", "mqa-tied", 4, 1, True)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def case(request, tmp_path_factory):
    family, _, heads, kv, tie = request.param
    extra = {"sliding_window": None} if family == "mistral" else {}
    hf = _qwen2_with_biases(heads, kv, tie) if family == "qwen2" else _hf_model(family, heads, kv, tie, **extra)
    return family, hf, _save(hf, tmp_path_factory.mktemp(family))


def test_logits_match_transformers(case):
    family, hf, path = case
    model, params = from_hf(path)
    assert type(model) is {"qwen2": Qwen2, "qwen3": Qwen3, "mistral": Mistral, "gemma": Gemma}[family]
    assert model.config.tie_embeddings == hf.config.tie_word_embeddings
    assert model.config.n_kv_heads == hf.config.num_key_value_heads
    ids = _ids(48)
    assert _max_diff(model.apply(params, ids), _hf_logits(hf, ids)) < TOL


def test_export_is_exact_and_transformers_reloads_it(case, tmp_path):
    _, hf, path = case
    model, params = from_hf(path, scan_layers=True)
    to_hf(model, params, tmp_path)
    _assert_files_equal(path, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert type(reloaded) is type(hf)
    ids = _ids(48)
    assert _max_diff(_hf_logits(reloaded, ids), _hf_logits(hf, ids)) == 0.0


def test_qwen2_biases_are_loaded_and_matter(tmp_path):
    model, params = from_hf(_save(_qwen2_with_biases(), tmp_path))
    bias = params["blocks"]["attn"]["wq"]["bias"][0]
    assert bias.abs().sum() > 0 and "bias" not in params["blocks"]["attn"]["wo"]
    zeroed = pytree.tree_map_with_path(lambda p, t: torch.zeros_like(t) if p.endswith("bias") else t, params)
    ids = _ids(16)
    assert _max_diff(model.apply(zeroed, ids), model.apply(params, ids)) > 1e-3


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """A window shorter than the sequence: tokens past it no longer see the start."""
    hf = _hf_model("mistral", 4, 2, False, sliding_window=8)
    model, params = from_hf(_save(hf, tmp_path))
    assert model.config.sliding_window == 8
    ids = _ids(40)
    got = model.apply(params, ids)
    assert _max_diff(got, _hf_logits(hf, ids)) < TOL
    unwindowed = Mistral(model.config.replace(sliding_window=None)).apply(params, ids)
    assert _max_diff(unwindowed[:, :8], got[:, :8]) < 1e-5 and _max_diff(unwindowed, got) > 1e-3


# Every family through Dynamo and AOTAutograd whole (fullgraph: no graph break, the backward traced);
# Inductor's lowering once, for Gemma's ops of its own (tanh GELU, 1 + w norms); the others' blocks are
# Llama's with q/k norms, biases or a window, which Inductor compiles in test_sft.py, test_attention_chunks.py
# and every qwen3_moe test.
@pytest.mark.parametrize("family,backend", [("qwen2", "aot_eager"), ("qwen3", "aot_eager"),
                                            ("mistral", "aot_eager"), ("gemma", "inductor")])
def test_tiny_presets_train_compiled(family, backend):
    model = build_model(family, "tiny")
    params = model.init(random.key(0))
    tokens = random.randint(random.key(1), (2, 33), 0, model.config.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    state = TrainState.create(params=params, tx=optim.adamw(1e-2), key=random.key(2))
    step = torch.compile(train_step(lm_loss(model)), fullgraph=True, backend=backend)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]


def test_configs_refuse_what_their_hf_models_lack():
    with pytest.raises(ValueError, match=r"use_sliding_window=True.*use_sliding_window=False"):
        config_from_hf({"model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(ValueError, match=r"Llama has no qkv_bias.*qwen2"):
        to_hf(build_model("llama3", "tiny", qkv_bias=True), {}, "/nonexistent")
    with pytest.raises(ValueError, match=r"no attention biases"):
        to_hf(Mistral(MistralConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50,
                                    qkv_bias=True)), {}, "/nonexistent")
    with pytest.raises(TypeError, match=r"Qwen2 needs a Qwen2Config"):
        Qwen2(MistralConfig())


def test_other_causal_lm_trains_through_the_bridge(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.OlmoConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                                  bos_token_id=0, eos_token_id=0)
    hf = transformers.OlmoForCausalLM(cfg).eval()
    path = _save(hf, tmp_path)
    with pytest.warns(UserWarning, match=r"model_type 'olmo' has no native ember family.*from_torch bridge"):
        model, params = from_hf(path)
    assert isinstance(model, TorchModel)
    ids = _ids(24)
    assert _max_diff(model.apply(params, ids), _hf_logits(hf, ids)) < TOL
    assert model.axes["model"]["layers"]["0"]["self_attn"]["q_proj"]["weight"] == ("heads", "embed")
    loss = lm_loss(model)(params, {"inputs": ids[:, :-1], "targets": ids[:, 1:]}, key=None)
    assert torch.isfinite(loss.mean())
    with pytest.raises(ValueError, match=r"\['scan_layers'\] are fields of ember's native families"):
        from_hf(path, scan_layers=True)
