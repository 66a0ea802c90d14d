"""Llama-3 family: forward, GQA, RoPE positions, packing, tying, shapes of the real presets."""

from __future__ import annotations

import math

import pytest
import torch

from ember.core import pytree as epytree
from ember.core import random
from ember.core.testing import assert_tree_all_finite, assert_trees_all_close, assert_trees_all_equal
from ember.core.transforms import grad, stack_trees
from ember.models import Llama3, Llama3Config, build_model, count_params, get_config
from ember.models.layers import RopeScaling


def _tokens(b: int = 2, t: int = 16, vocab: int = 256) -> torch.Tensor:
    return random.randint(random.key(5), (b, t), 0, vocab)


def _loss(model):
    def loss(params, tokens):
        logits = model.apply(params, tokens)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    return loss


def test_forward_shape_dtype(llama3_cfg):
    model = Llama3(llama3_cfg)
    params = model.init(random.key(0))
    logits = model.apply(params, _tokens())
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    assert abs(_loss(model)(params, _tokens()).item() - math.log(256)) < 0.1


def test_grads_finite(llama3_cfg):
    model = Llama3(llama3_cfg)
    params = model.init(random.key(0))
    g = grad(_loss(model))(params, _tokens())
    assert_tree_all_finite(g)
    assert all(t.abs().sum() > 0 for t in epytree.tree_leaves(g))  # every parameter is used


def test_causal(llama3_cfg):
    model = Llama3(llama3_cfg)
    params, tok = model.init(random.key(0)), _tokens(b=1, t=10)
    changed = tok.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 256
    a, b = model.apply(params, tok), model.apply(params, changed)
    assert_trees_all_close(a[:, :6], b[:, :6], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_tied_vs_untied(llama3_cfg):
    untied, tied = Llama3(llama3_cfg), Llama3(llama3_cfg.replace(tie_embeddings=True))
    assert "lm_head" in untied.param_shapes() and "lm_head" not in tied.param_shapes()
    p = untied.init(random.key(0))
    p_tied = {k: v for k, v in p.items() if k != "lm_head"}
    p_same = {**p, "lm_head": {"weight": p["wte"]["weight"]}}
    assert_trees_all_close(untied.apply(p_same, _tokens()), tied.apply(p_tied, _tokens()), rtol=1e-6, atol=1e-6)


def test_packed_segments_equal_separate_sequences(llama3_cfg):
    model = Llama3(llama3_cfg)
    params = model.init(random.key(0))
    a, b = _tokens(b=1, t=5), random.randint(random.key(8), (1, 7), 0, 256)
    packed = torch.cat([a, b], dim=1)
    seg = torch.tensor([[0] * 5 + [1] * 7])
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    out = model.apply(params, packed, segment_ids=seg, positions=pos)
    assert_trees_all_close(out[:, :5], model.apply(params, a), rtol=1e-5, atol=1e-5)
    assert_trees_all_close(out[:, 5:], model.apply(params, b), rtol=1e-5, atol=1e-5)


def test_rope_scaling_changes_only_long_wavelengths(llama3_cfg):
    base = Llama3(llama3_cfg)
    scaled = Llama3(llama3_cfg.replace(rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=16)))
    params, tok = base.init(random.key(0)), _tokens()
    assert_trees_all_equal(params, scaled.init(random.key(0)))  # no parameters involved
    assert not torch.allclose(base.apply(params, tok), scaled.apply(params, tok))


def test_scan_layers_equals_unrolled(llama3_cfg):
    unrolled, scanned = Llama3(llama3_cfg.replace(scan_layers=False)), Llama3(llama3_cfg.replace(remat=True))
    p_u, p_s = unrolled.init(random.key(0)), scanned.init(random.key(0))
    restacked = {**p_u, "blocks": stack_trees(p_u["blocks"])}
    assert_trees_all_equal(restacked, p_s)
    assert epytree.tree_paths(p_s)[1] == "blocks.ln_1.weight"
    assert scanned.axes["blocks"]["attn"]["wk"]["weight"] == ("layers", "kv_heads", "embed")
    tok = _tokens()
    assert_trees_all_close(scanned.apply(p_s, tok), unrolled.apply(p_u, tok), rtol=1e-5, atol=1e-6)
    g_u, g_s = grad(_loss(unrolled))(p_u, tok), grad(_loss(scanned))(p_s, tok)
    assert_trees_all_close(g_s, {**g_u, "blocks": stack_trees(g_u["blocks"])}, rtol=1e-5, atol=1e-7)


def test_param_tree_layout():
    model = build_model("llama3", "tiny", n_layers=2, tie_embeddings=False)
    shapes = {p: tuple(t.shape) for p, t in epytree.tree_leaves_with_path(model.param_shapes())}
    assert shapes == {
        "wte.weight": (256, 128),
        "blocks.ln_1.weight": (2, 128),
        "blocks.attn.wq.weight": (2, 128, 128),
        "blocks.attn.wk.weight": (2, 64, 128),
        "blocks.attn.wv.weight": (2, 64, 128),
        "blocks.attn.wo.weight": (2, 128, 128),
        "blocks.ln_2.weight": (2, 128),
        "blocks.mlp.gate.weight": (2, 384, 128),
        "blocks.mlp.up.weight": (2, 384, 128),
        "blocks.mlp.down.weight": (2, 128, 384),
        "ln_f.weight": (128,),
        "lm_head.weight": (256, 128),
    }
    listed = build_model("llama3", "tiny", n_layers=2, tie_embeddings=False, scan_layers=False).param_shapes()
    assert len(listed["blocks"]) == 2 and tuple(listed["blocks"][1]["mlp"]["down"]["weight"].shape) == (128, 384)


# (arch, expected parameter count from the published model cards / HF safetensors)
REAL_SHAPES = [("8b", 8_030_261_248), ("1b", 1_235_814_400), ("3b", 3_212_749_824), ("70b", 70_553_706_496)]


@pytest.mark.parametrize("arch,expected", REAL_SHAPES, ids=[a for a, _ in REAL_SHAPES])
def test_real_presets_param_counts_without_allocating(arch, expected):
    model = build_model("llama3", arch)
    shapes = model.param_shapes()
    assert {t.device.type for t in epytree.tree_leaves(shapes)} == {"meta"}
    assert count_params(model) == expected


def test_8b_shapes():
    cfg = get_config("llama3", "8b")
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) == (
        128256, 4096, 32, 32, 8, 14336)
    blk = build_model("llama3", "8b").param_shapes()["blocks"]
    assert blk["attn"]["wk"]["weight"].shape == (32, 1024, 4096)  # 32 layers x 8 KV heads x 128
    assert blk["mlp"]["down"]["weight"].shape == (32, 4096, 14336)


# (overrides, error type, message pattern)
INVALID_CONFIGS = [
    (dict(n_heads=5), ValueError, r"Llama3Config.n_heads=5 does not divide Llama3Config.d_model=4096"),
    (dict(n_kv_heads=3), ValueError, r"Llama3Config.n_kv_heads=3 does not divide Llama3Config.n_heads=32"),
    (dict(d_model=96, n_heads=32, n_kv_heads=8), ValueError, r"head_dim = 3 must be a positive even number.*d_model=96, n_heads=32 or attn_head_dim"),
    (dict(ffn_dim=0), ValueError, r"Llama3Config.ffn_dim must be positive"),
    (dict(rope_scaling={"factor": 8}), TypeError, r"rope_scaling must be a RopeScaling, a YarnScaling or None"),
    (dict(n_kv_head=8), ValueError, r"no field 'n_kv_head'; did you mean 'n_kv_heads'"),
]


@pytest.mark.parametrize("overrides,exc,match", INVALID_CONFIGS, ids=[next(iter(c[0])) for c in INVALID_CONFIGS])
def test_config_validation(overrides, exc, match):
    with pytest.raises(exc, match=match):
        Llama3Config().replace(**overrides)


def test_too_long_sequence_names_the_field(llama3_cfg):
    model = Llama3(llama3_cfg)
    with pytest.raises(ValueError, match=r"exceeds Llama3Config.max_seq_len=32"):
        model.apply(model.init(random.key(0)), _tokens(t=40))
