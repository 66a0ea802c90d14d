"""GPT-2 family: forward, init statistics, dropout, config validation, parameter layout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as pytree

from ember.core import pytree as epytree
from ember.core import random
from ember.core.testing import assert_tree_all_finite, assert_trees_all_close, assert_trees_all_equal
from ember.core.transforms import grad, stack_trees
from ember.models import GPT2, GPT2Config, build_model, count_params
from ember.models.layers import initializers as inits


def _tokens(b: int = 2, t: int = 16, vocab: int = 256) -> torch.Tensor:
    return random.randint(random.key(5), (b, t), 0, vocab)


def _loss(model):
    def loss(params, tokens, key=None):
        logits = model.apply(params, tokens, key=key)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    return loss


def test_forward_shape_dtype(gpt2_cfg):
    model = GPT2(gpt2_cfg)
    logits = model.apply(model.init(random.key(0)), _tokens())
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_bf16_params_give_float32_logits(gpt2_cfg):
    model = GPT2(gpt2_cfg)
    params = pytree.tree_map(lambda t: t.bfloat16(), model.init(random.key(0)))
    assert model.apply(params, _tokens()).dtype == torch.float32


def test_initial_loss_is_near_uniform(gpt2_cfg):
    model = GPT2(gpt2_cfg)
    loss = _loss(model)(model.init(random.key(0)), _tokens())
    assert abs(loss.item() - math.log(256)) < 0.1


def test_grads_finite_with_dropout(gpt2_cfg):
    model = GPT2(gpt2_cfg.replace(dropout=0.1))
    params = model.init(random.key(0))
    g = grad(_loss(model))(params, _tokens(), random.key(1))
    assert_tree_all_finite(g)
    assert epytree.tree_structure(g) == epytree.tree_structure(params)


def test_dropout_needs_a_key(gpt2_cfg):
    model = GPT2(gpt2_cfg.replace(dropout=0.2))
    params, tok = model.init(random.key(0)), _tokens()
    no_key = model.apply(params, tok)
    assert torch.equal(no_key, GPT2(gpt2_cfg).apply(params, tok))  # key=None: dropout off
    a = model.apply(params, tok, key=random.key(1))
    assert torch.equal(a, model.apply(params, tok, key=random.key(1)))
    assert not torch.allclose(a, no_key)


def test_residual_projections_use_scaled_init():
    cfg = GPT2Config(vocab_size=256, max_seq_len=16, n_layers=8, n_heads=4, d_model=64)
    model = GPT2(cfg)
    scaled = 0.02 / math.sqrt(2 * 8)  # GPT-2 §2.3: residual projections scaled by 1/sqrt(N), N = 2 per block
    blk = model.children["blocks"].layer
    assert blk.attn.out_init == inits.normal(scaled) and blk.mlp.proj_init == inits.normal(scaled)
    assert blk.attn.qkv_init == inits.normal(0.02) and blk.mlp.fc_init == inits.normal(0.02)
    params = model.init(random.key(0))
    p0 = epytree.tree_map(lambda leaf: leaf[0], params["blocks"])
    assert abs(p0["mlp"]["proj"]["weight"].std().item() - scaled) < 0.05 * scaled
    assert abs(p0["attn"]["wq"]["weight"].std().item() - 0.02) < 0.002
    assert torch.equal(p0["ln_1"]["weight"], torch.ones(64)) and torch.equal(p0["attn"]["wq"]["bias"], torch.zeros(64))


def test_positions_kwarg_shifts_learned_positions(gpt2_cfg):
    model = GPT2(gpt2_cfg)
    params, tok = model.init(random.key(0)), _tokens(t=8)
    default = model.apply(params, tok)
    assert torch.equal(default, model.apply(params, tok, positions=torch.arange(8)))
    assert not torch.allclose(default, model.apply(params, tok, positions=torch.arange(8) + 3))


def test_scan_layers_equals_unrolled(gpt2_cfg):
    unrolled, scanned = GPT2(gpt2_cfg.replace(scan_layers=False)), GPT2(gpt2_cfg)
    p_u, p_s = unrolled.init(random.key(0)), scanned.init(random.key(0))
    assert_trees_all_equal({**p_u, "blocks": stack_trees(p_u["blocks"])}, p_s)
    tok = _tokens()
    assert_trees_all_close(scanned.apply(p_s, tok), unrolled.apply(p_u, tok), rtol=1e-5, atol=1e-6)
    g_u, g_s = grad(_loss(unrolled))(p_u, tok), grad(_loss(scanned))(p_s, tok)
    assert_trees_all_close(g_s, {**g_u, "blocks": stack_trees(g_u["blocks"])}, rtol=1e-5, atol=1e-7)


def test_param_tree_layout():
    model = build_model("gpt2", "tiny", n_layers=1)
    paths = epytree.tree_paths(model.param_shapes())
    assert paths == [
        "wte.weight", "wpe.weight",
        "blocks.ln_1.weight", "blocks.ln_1.bias",
        "blocks.attn.wq.weight", "blocks.attn.wq.bias", "blocks.attn.wk.weight", "blocks.attn.wk.bias",
        "blocks.attn.wv.weight", "blocks.attn.wv.bias", "blocks.attn.wo.weight", "blocks.attn.wo.bias",
        "blocks.ln_2.weight", "blocks.ln_2.bias",
        "blocks.mlp.fc.weight", "blocks.mlp.fc.bias", "blocks.mlp.proj.weight", "blocks.mlp.proj.bias",
        "ln_f.weight", "ln_f.bias",
    ]
    shapes = model.param_shapes()
    assert shapes["wpe"]["weight"].shape == (128, 64) and model.axes["wpe"]["weight"] == (None, "embed")
    assert shapes["blocks"]["mlp"]["fc"]["weight"].shape == (1, 256, 64)
    assert model.axes["blocks"]["mlp"]["fc"]["weight"] == ("layers", "mlp", "embed")
    listed = build_model("gpt2", "tiny", n_layers=1, scan_layers=False)
    assert epytree.tree_paths(listed.param_shapes())[2] == "blocks.0.ln_1.weight"


def test_gpt2_small_has_124m_params():
    assert count_params(build_model("gpt2", "small")) == 124_439_808  # HF gpt2, tied


def test_no_bias_variant(gpt2_cfg):
    model = GPT2(gpt2_cfg.replace(bias=False))
    assert not any(p.endswith("bias") for p in epytree.tree_paths(model.param_shapes()))
    assert model.apply(model.init(random.key(0)), _tokens()).shape == (2, 16, 256)


# (overrides, error type, message pattern)
INVALID_CONFIGS = [
    (dict(n_heads=5), ValueError, r"GPT2Config.n_heads=5 does not divide GPT2Config.d_model=768"),
    (dict(n_layers=0), ValueError, r"GPT2Config.n_layers must be positive"),
    (dict(d_model=64.0), TypeError, r"GPT2Config.d_model must be an int"),
    (dict(dropout=1.0), ValueError, r"GPT2Config.dropout must be in \[0.0, 1.0\)"),
    (dict(activation="relu"), ValueError, r"GPT2Config.activation must be one of \['gelu', 'gelu_tanh'\]"),
    (dict(n_layer=3), ValueError, r"no field 'n_layer'; did you mean 'n_layers'"),
]


@pytest.mark.parametrize("overrides,exc,match", INVALID_CONFIGS, ids=[next(iter(c[0])) for c in INVALID_CONFIGS])
def test_config_validation(overrides, exc, match):
    with pytest.raises(exc, match=match):
        GPT2Config().replace(**overrides)


def test_too_long_sequence_names_the_field(gpt2_cfg):
    model = GPT2(gpt2_cfg)
    with pytest.raises(ValueError, match=r"sequence length 33 exceeds GPT2Config.max_seq_len=32"):
        model.apply(model.init(random.key(0)), _tokens(t=33))
    with pytest.raises(TypeError, match="integer token ids"):
        model.apply(model.init(random.key(0)), torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"shape \(B, T\)"):
        model.apply(model.init(random.key(0)), torch.zeros(4, dtype=torch.long))
