"""Layer DSL: declarations vs init, axes, shapes, numerics against torch.nn and first principles."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.utils._pytree as pytree

from ember.core import random
from ember.core.testing import assert_trees_all_close, assert_trees_all_equal
from ember.core.transforms import grad, stack_trees
from ember.models import GPT2, GPT2Config, Llama3, Llama3Config
from ember.models.gpt2 import MLP, Block, CausalSelfAttention
from ember.models.layers import (
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    Module,
    Param,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
    Sequential,
    Stacked,
    Stacks,
    dot_product_attention,
    path_key,
    repeat_kv,
    rope_frequencies,
)
from ember.models.layers import initializers as inits
from ember.models.llama3 import Attention, SwiGLU
from ember.models.llama3 import Block as LlamaBlock

D = 16


def _block(dropout: float = 0.0) -> Block:
    return Block(
        attn=Attention(D, 4, 2, rope=RotaryEmbedding(4), dropout=dropout),
        mlp=SwiGLU(D, 32),
        ln_1=RMSNorm(D),
        ln_2=RMSNorm(D),
        dropout=dropout,
    )


def _x(*shape: int) -> torch.Tensor:
    return random.normal(random.key(123), shape)


# (id, layer, input, expected output shape)
LAYER_CASES = [
    ("linear", Linear(D, 8, in_axis="embed", out_axis="mlp"), lambda: _x(2, 3, D), (2, 3, 8)),
    ("linear_nobias", Linear(D, 8, bias=False), lambda: _x(5, D), (5, 8)),
    ("linear_bf16", Linear(D, 8, dtype=torch.bfloat16), lambda: _x(5, D).bfloat16(), (5, 8)),
    ("embedding", Embedding(50, D), lambda: torch.tensor([[1, 2, 49]]), (1, 3, D)),
    ("layernorm", LayerNorm(D), lambda: _x(2, 3, D), (2, 3, D)),
    ("layernorm_nobias", LayerNorm(D, bias=False), lambda: _x(2, 3, D), (2, 3, D)),
    ("rmsnorm", RMSNorm(D), lambda: _x(2, 3, D), (2, 3, D)),
    ("rope", RotaryEmbedding(8), lambda: _x(2, 5, 3, 8), (2, 5, 3, 8)),
    ("attention_mha", Attention(D, 4, bias=True), lambda: _x(2, 5, D), (2, 5, D)),
    ("attention_gqa_rope", Attention(D, 4, 1, rope=RotaryEmbedding(4)), lambda: _x(2, 5, D), (2, 5, D)),
    ("mlp", MLP(D, 4 * D, activation="gelu_tanh"), lambda: _x(2, 5, D), (2, 5, D)),
    ("swiglu", SwiGLU(D, 40), lambda: _x(2, 5, D), (2, 5, D)),
    ("dropout", Dropout(0.5), lambda: _x(2, 5, D), (2, 5, D)),
    ("block", _block(), lambda: _x(2, 5, D), (2, 5, D)),
    ("sequential", Sequential.repeat(_block(), 2), lambda: _x(2, 5, D), (2, 5, D)),
    ("stacked", Stacked(_block(), 3), lambda: _x(2, 5, D), (2, 5, D)),
]
IDS = [c[0] for c in LAYER_CASES]


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


@pytest.mark.parametrize("name,layer,make_x,out_shape", LAYER_CASES, ids=IDS)
def test_output_shape(name, layer, make_x, out_shape):
    params = layer.init(random.key(0))
    out = layer.apply(params, make_x())
    assert tuple(out.shape) == out_shape
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("name,layer,make_x,out_shape", LAYER_CASES, ids=IDS)
def test_init_matches_declaration(name, layer, make_x, out_shape):
    params = layer.init(random.key(0))
    shapes = layer.param_shapes()
    specs = layer.param_specs()
    # Same tree structure for params, meta shapes and declarations.
    assert pytree.tree_structure(params) == pytree.tree_structure(shapes)
    assert pytree.tree_structure(params) == pytree.tree_structure(specs)
    for p, s, spec in zip(pytree.tree_leaves(params), pytree.tree_leaves(shapes), pytree.tree_leaves(specs)):
        assert s.device.type == "meta"
        assert p.shape == s.shape == torch.Size(spec.shape)
        assert p.dtype == s.dtype == spec.dtype
    # Axes: the same structure with one tuple of len == ndim per parameter.
    axes_leaves, axes_spec = pytree.tree_flatten(layer.axes, is_leaf=_is_axes)
    assert axes_spec == pytree.tree_structure(params)
    for ax, p in zip(axes_leaves, pytree.tree_leaves(params)):
        assert isinstance(ax, tuple) and len(ax) == p.dim()
        assert all(a is None or isinstance(a, str) for a in ax)


def test_param_less_layers_have_empty_trees():
    for layer in (Dropout(0.1), RotaryEmbedding(8)):
        assert not layer.has_params
        assert layer.init(random.key(0)) == {} and layer.axes == {}
    # ...and are left out of their parent's tree.
    attn = Attention(D, 4, rope=RotaryEmbedding(4))
    assert list(attn.init(random.key(0))) == ["wq", "wk", "wv", "wo"]
    assert set(_block().init(random.key(0))) == {"ln_1", "attn", "ln_2", "mlp"}


def test_dtype_declared_is_dtype_created():
    lin = Linear(4, 4, dtype=torch.bfloat16)
    assert {t.dtype for t in pytree.tree_leaves(lin.init(random.key(0)))} == {torch.bfloat16}


def test_axes_names():
    attn = Attention(D, 4, 2, bias=True)
    assert attn.axes == {
        "wq": {"weight": ("heads", "embed"), "bias": ("heads",)},
        "wk": {"weight": ("kv_heads", "embed"), "bias": ("kv_heads",)},
        "wv": {"weight": ("kv_heads", "embed"), "bias": ("kv_heads",)},
        "wo": {"weight": ("embed", "heads"), "bias": ("embed",)},
    }
    assert Stacked(SwiGLU(D, 8), 2).axes["down"]["weight"] == ("layers", "embed", "mlp")
    assert Embedding(8, 4, vocab_axis=None).axes == {"weight": (None, "embed")}


def test_init_is_deterministic_and_keys_differ_per_param():
    a = _block().init(random.key(0))
    assert_trees_all_equal(a, _block().init(random.key(0)))
    assert not torch.equal(a["attn"]["wk"]["weight"], a["attn"]["wv"]["weight"])
    b = _block().init(random.key(1))
    assert not torch.equal(a["attn"]["wq"]["weight"], b["attn"]["wq"]["weight"])


def test_adding_a_layer_keeps_other_inits():
    two = Sequential.repeat(_block(), 2).init(random.key(0))
    three = Sequential.repeat(_block(), 3).init(random.key(0))
    assert_trees_all_equal(three[:2], two)

    @dataclasses.dataclass(frozen=True)
    class WithExtra(Module):
        def declare(self):
            return {"ln_1": RMSNorm(D), "extra": Linear(D, D), "attn": Attention(D, 4, 2, rope=RotaryEmbedding(4)),
                    "ln_2": RMSNorm(D), "mlp": SwiGLU(D, 32)}

    extra = WithExtra().init(random.key(0))
    base = _block().init(random.key(0))
    assert_trees_all_equal({k: extra[k] for k in base}, base)


def test_meta_key_initialises_on_meta():
    params = Stacked(_block(), 2).init(random.key(0, device="meta"))
    assert {t.device.type for t in pytree.tree_leaves(params)} == {"meta"}


# ---------------------------------------------------------------------------------- numerics


def test_linear_matches_torch():
    lin = Linear(D, 8)
    params = lin.init(random.key(0))
    ref = torch.nn.Linear(D, 8)
    with torch.no_grad():
        ref.weight.copy_(params["weight"])
        ref.bias.copy_(params["bias"])
    x = _x(3, D)
    assert_trees_all_close(lin.apply(params, x), ref(x).detach(), rtol=1e-6, atol=1e-6)


def test_layernorm_matches_torch():
    norm = LayerNorm(D, eps=1e-5)
    params = {"weight": _x(D) + 1, "bias": _x(D) * 0.1}
    ref = torch.nn.LayerNorm(D, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(params["weight"])
        ref.bias.copy_(params["bias"])
    x = _x(2, 3, D) * 3 + 1
    assert_trees_all_close(norm.apply(params, x), ref(x).detach(), rtol=1e-5, atol=1e-6)


def test_rmsnorm_matches_torch():
    norm = RMSNorm(D, eps=1e-5)
    params = {"weight": _x(D) + 1}
    ref = torch.nn.RMSNorm(D, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(params["weight"])
    x = _x(2, 3, D) * 3
    assert_trees_all_close(norm.apply(params, x), ref(x).detach(), rtol=1e-5, atol=1e-6)


def test_rmsnorm_bf16_computes_in_float32():
    norm = RMSNorm(D)
    params = {"weight": torch.ones(D, dtype=torch.bfloat16)}
    x = (_x(4, D) * 100).bfloat16()
    out = norm.apply(params, x)
    assert out.dtype == torch.bfloat16
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert_trees_all_close(out.float(), ref.bfloat16().float(), rtol=0, atol=0)


def test_embedding_attend_is_transpose():
    emb = Embedding(10, D)
    params = emb.init(random.key(0))
    x = _x(2, D)
    assert_trees_all_close(emb.attend(params, x), x @ params["weight"].T, rtol=1e-6, atol=1e-6)
    assert torch.equal(emb.apply(params, torch.tensor([3])), params["weight"][3:4])


def test_rope_relative_position_property():
    """<R(m) q, R(n) k> depends only on m - n (RoFormer, eq. 16)."""
    rope = RotaryEmbedding(8, theta=10000.0)
    q, k = _x(1, 1, 1, 8), random.normal(random.key(7), (1, 1, 1, 8))

    def score(m: int, n: int) -> torch.Tensor:
        qm = rope.apply({}, q, positions=torch.tensor([m]))
        kn = rope.apply({}, k, positions=torch.tensor([n]))
        return (qm * kn).sum()

    for shift in (1, 5, 100):
        assert_trees_all_close(score(3, 1), score(3 + shift, 1 + shift), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(3, 1), score(3, 2))
    # Rotations preserve norms, and position 0 is the identity.
    assert_trees_all_close(rope.apply({}, q, positions=torch.tensor([9])).norm(), q.norm(), rtol=1e-6, atol=1e-6)
    assert_trees_all_close(rope.apply({}, q, positions=torch.tensor([0])), q, rtol=0, atol=0)


def test_rope_batched_positions_equal_shared_positions():
    rope = RotaryEmbedding(8)
    x = _x(2, 5, 3, 8)
    pos = torch.arange(5)
    assert_trees_all_close(rope.apply({}, x, positions=pos), rope.apply({}, x, positions=pos.expand(2, 5)))
    assert_trees_all_close(rope.apply({}, x), rope.apply({}, x, positions=pos))


def _meta_apply_scaling(freqs, factor, low, high, old_len):
    """Meta's reference `apply_scaling` (llama-models, Llama 3.1), written as a Python loop."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_rope_llama31_scaling_matches_meta_reference():
    base = rope_frequencies(128, theta=500000.0)
    scaled = rope_frequencies(128, theta=500000.0, scaling=RopeScaling())
    ref = _meta_apply_scaling(base.tolist(), 8.0, 1.0, 4.0, 8192)
    assert_trees_all_close(scaled, torch.tensor(ref, dtype=torch.float32), rtol=1e-6, atol=0)
    assert torch.equal(scaled[:8], base[:8])  # high frequencies untouched
    assert_trees_all_close(scaled[-1], base[-1] / 8, rtol=1e-6, atol=0)  # lowest scaled by the factor


def test_attention_is_causal():
    attn = Attention(D, 4, 2, rope=RotaryEmbedding(4))
    params = attn.init(random.key(0))
    x = _x(1, 6, D)
    y = x.clone()
    y[:, 4] += 1.0  # change position 4 only
    a, b = attn.apply(params, x), attn.apply(params, y)
    assert_trees_all_close(a[:, :4], b[:, :4], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_gqa_equals_mha_with_repeated_kv_weights():
    h, kv, hd = 4, 2, D // 4
    gqa = Attention(D, h, kv, rope=RotaryEmbedding(hd))
    mha = Attention(D, h, h, rope=RotaryEmbedding(hd))
    p = gqa.init(random.key(0))

    def rep(w: torch.Tensor) -> torch.Tensor:  # (KV*D, d) -> (H*D, d): head j serves heads j*G..j*G+G-1
        return w.view(kv, hd, D).repeat_interleave(h // kv, dim=0).reshape(h * hd, D)

    p_mha = {"wq": p["wq"], "wo": p["wo"], "wk": {"weight": rep(p["wk"]["weight"])},
             "wv": {"weight": rep(p["wv"]["weight"])}}
    x = _x(2, 5, D)
    assert_trees_all_close(gqa.apply(p, x), mha.apply(p_mha, x), rtol=1e-5, atol=1e-6)


def test_grouped_keys_and_values_equal_repeated_ones_and_mismatched_heads_name_the_fix():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)  # (B, H or KV, T, D)
    for kwargs in ({}, {"segment_ids": torch.tensor([[0, 0, 1, 1, 1]] * 2)}, {"token_index": torch.arange(5)}):
        assert_trees_all_close(dot_product_attention(q, k, v, **kwargs),
                               dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), **kwargs), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="4 query heads against 3 key and 3 value heads.*n_kv_heads"):
        dot_product_attention(q, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8))


def test_attention_matches_explicit_softmax():
    attn = Attention(D, 4, bias=True)
    p = attn.init(random.key(0))
    x = _x(2, 5, D)
    q = (x @ p["wq"]["weight"].T + p["wq"]["bias"]).view(2, 5, 4, 4).transpose(1, 2)
    k = (x @ p["wk"]["weight"].T + p["wk"]["bias"]).view(2, 5, 4, 4).transpose(1, 2)
    v = (x @ p["wv"]["weight"].T + p["wv"]["bias"]).view(2, 5, 4, 4).transpose(1, 2)
    s = (q @ k.transpose(-1, -2)) / 2.0 + torch.triu(torch.full((5, 5), float("-inf")), 1)
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, D)
    ref = o @ p["wo"]["weight"].T + p["wo"]["bias"]
    assert_trees_all_close(attn.apply(p, x), ref, rtol=1e-5, atol=1e-6)


def test_segment_ids_isolate_packed_sequences():
    attn = Attention(D, 4, 2, rope=RotaryEmbedding(4))
    p = attn.init(random.key(0))
    x = _x(1, 7, D)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    packed = attn.apply(p, x, segment_ids=seg, positions=pos)
    assert_trees_all_close(packed[:, :3], attn.apply(p, x[:, :3]), rtol=1e-5, atol=1e-6)
    assert_trees_all_close(packed[:, 3:], attn.apply(p, x[:, 3:]), rtol=1e-5, atol=1e-6)


def test_padding_mask_ignores_padding_and_never_nans():
    attn = Attention(D, 4)
    p = attn.init(random.key(0))
    x = _x(1, 6, D)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])  # left padding
    out = attn.apply(p, x, attention_mask=mask)
    assert torch.isfinite(out).all()
    garbage = x.clone()
    garbage[:, :2] = 100.0
    out2 = attn.apply(p, garbage, attention_mask=mask)
    assert_trees_all_close(out[:, 2:], out2[:, 2:], rtol=1e-5, atol=1e-6)


def test_attention_dropout_path():
    attn = Attention(D, 4, dropout=1e-7)
    p = attn.init(random.key(0))
    x = _x(2, 5, D)
    # With a key the explicit-softmax path runs; at a negligible rate it equals the fused kernel.
    assert_trees_all_close(attn.apply(p, x, key=random.key(3)), attn.apply(p, x), rtol=1e-5, atol=1e-6)
    heavy = Attention(D, 4, dropout=0.5)
    a = heavy.apply(p, x, key=random.key(3))
    assert torch.equal(a, heavy.apply(p, x, key=random.key(3)))
    assert not torch.allclose(a, heavy.apply(p, x, key=random.key(4)))
    assert torch.equal(heavy.apply(p, x), attn.apply(p, x))  # no key: deterministic


def test_family_attentions_and_blocks_agree():
    """GPT-2's attention is Llama's without GQA / RoPE, plus biases: same params, same outputs, bit for bit."""
    gpt2_attn, llama_attn = CausalSelfAttention(D, 4, dropout=0.5), Attention(D, 4, bias=True, dropout=0.5)
    p = gpt2_attn.init(random.key(0))
    assert_trees_all_equal(p, llama_attn.init(random.key(0)))
    x, seg = _x(2, 5, D), torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    for kwargs in ({}, {"key": random.key(3)}, {"segment_ids": seg}):
        assert torch.equal(gpt2_attn.apply(p, x, **kwargs), llama_attn.apply(p, x, **kwargs))
    parts = dict(attn=Attention(D, 4, 2, rope=RotaryEmbedding(4)), mlp=SwiGLU(D, 32), ln_1=RMSNorm(D), ln_2=RMSNorm(D))
    llama_blk, gpt2_blk = LlamaBlock(**parts), Block(**parts)
    q = llama_blk.init(random.key(0))
    assert torch.equal(llama_blk.apply(q, x, key=random.key(1)), gpt2_blk.apply(q, x, key=random.key(1)))


@pytest.mark.parametrize("name,new_home", [("Attention", "llama3"), ("SwiGLU", "llama3"), ("MLP", "gpt2"),
                                           ("Block", "gpt2"), ("ACTIVATIONS", "gpt2")])
def test_moved_layer_names_warn_and_resolve(name, new_home):
    import importlib

    import ember.models.layers as layers

    with pytest.warns(DeprecationWarning, match=rf"ember\.models\.layers\.{name} moved to ember\.models\.{new_home}"):
        old = getattr(layers, name)
    assert old is getattr(importlib.import_module(f"ember.models.{new_home}"), name)
    assert name not in layers.__all__
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        layers.Nope


def test_dropout_is_keyed():
    drop = Dropout(0.25)
    x = torch.ones(4000)
    assert torch.equal(drop.apply({}, x), x)
    a, b = drop.apply({}, x, key=random.key(0)), drop.apply({}, x, key=random.key(0))
    assert torch.equal(a, b)
    assert abs((a == 0).float().mean().item() - 0.25) < 0.03
    assert_trees_all_close(a.mean(), torch.tensor(1.0), rtol=0, atol=0.05)


def test_mlp_matches_formula():
    mlp = MLP(D, 32, activation="gelu")
    p = mlp.init(random.key(0))
    x = _x(3, D)
    h = torch.nn.functional.gelu(x @ p["fc"]["weight"].T + p["fc"]["bias"])
    assert_trees_all_close(mlp.apply(p, x), h @ p["proj"]["weight"].T + p["proj"]["bias"], rtol=1e-5, atol=1e-6)
    sw = SwiGLU(D, 32)
    q = sw.init(random.key(0))
    g = torch.nn.functional.silu(x @ q["gate"]["weight"].T) * (x @ q["up"]["weight"].T)
    assert_trees_all_close(sw.apply(q, x), g @ q["down"]["weight"].T, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------- stacked vs unrolled


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_stacked_equals_sequential(remat):
    blk = _block(dropout=0.1)
    seq = Sequential.repeat(blk, 3)
    stk = Stacked(blk, 3, remat=remat)
    p_seq = seq.init(random.key(0))
    p_stk = stk.init(random.key(0))
    assert_trees_all_equal(stack_trees(p_seq), p_stk)  # same init, bit for bit
    x = _x(2, 5, D)
    key = random.key(9)
    assert_trees_all_close(stk.apply(p_stk, x, key=key), seq.apply(p_seq, x, key=key), rtol=1e-6, atol=1e-6)

    def loss(model):
        return lambda p, x: (model.apply(p, x, key=key) ** 2).mean()

    g_seq = grad(loss(seq))(p_seq, x)
    g_stk = grad(loss(stk))(p_stk, x)
    assert_trees_all_close(g_stk, stack_trees(g_seq), rtol=1e-5, atol=1e-7)


def test_stacks_of_mixed_layers_equal_sequential():
    wide = dataclasses.replace(_block(dropout=0.1), mlp=SwiGLU(D, 48))  # another kind: other shapes
    layers = (_block(dropout=0.1),) * 2 + (wide,) * 3
    assert isinstance(Stacks.of(layers[:2]), Stacked)  # one run is a plain Stacked
    seq, stk = Sequential(layers), Stacks.of(layers, remat="full")
    assert [s.num_layers for s in stk.stacks] == [2, 3]
    p_seq, p_stk = seq.init(random.key(0)), stk.init(random.key(0))
    assert_trees_all_equal(stk.unstack(p_stk), p_seq)  # same init, layer by layer
    assert_trees_all_equal(stk.stack(p_seq), p_stk)
    assert stk.axes[1]["mlp"]["down"]["weight"] == ("layers", "embed", "mlp")
    x, key = _x(2, 5, D), random.key(9)
    assert_trees_all_close(stk.apply(p_stk, x, key=key), seq.apply(p_seq, x, key=key), rtol=1e-6, atol=1e-6)
    loss = lambda model: lambda p, x: (model.apply(p, x, key=key) ** 2).mean()  # noqa: E731
    assert_trees_all_close(stk.unstack(grad(loss(stk))(p_stk, x)), grad(loss(seq))(p_seq, x), rtol=1e-5, atol=1e-7)


def test_sequential_remat_grads_equal_plain():
    blk = _block()
    plain, rem = Sequential.repeat(blk, 2), Sequential.repeat(blk, 2, remat=True)
    p = plain.init(random.key(0))
    x = _x(2, 5, D)
    g1 = grad(lambda p: plain.apply(p, x).square().mean())(p)
    g2 = grad(lambda p: rem.apply(p, x).square().mean())(p)
    assert_trees_all_close(g2, g1, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------- kwargs


@dataclasses.dataclass(frozen=True)
class Recorder(Module):
    """A layer that records the keyword arguments it was called with (eager test only)."""

    name: str
    log: list = dataclasses.field(compare=False, hash=False)

    def declare(self):
        return {"scale": Param((D,), init=inits.ones(), axes=("embed",))}

    def apply(self, params, x, *, key=None, **kwargs):
        self.log.append((self.name, dict(kwargs)))
        return x * params["scale"]


def test_extra_kwargs_reach_every_layer():
    log: list = []
    rec = lambda n: Recorder(n, log)  # noqa: E731
    blk = Block(attn=rec("attn"), mlp=rec("mlp"), ln_1=rec("ln_1"), ln_2=rec("ln_2"))
    cases = [  # (model, expected recorder calls: 4 per block)
        (Sequential.repeat(blk, 2), 8),
        (Stacked(blk, 2), 8),
        (Sequential((Stacked(blk, 2), rec("head"))), 9),
    ]
    for model, calls in cases:
        log.clear()
        model.apply(model.init(random.key(0)), _x(1, 3, D), segment_ids="marker", positions=7)
        assert len(log) == calls
        assert all(kw == {"segment_ids": "marker", "positions": 7} for _, kw in log)
        assert {n for n, _ in log} >= {"attn", "mlp", "ln_1", "ln_2"}


@dataclasses.dataclass(frozen=True)
class KeyRecorder(Module):
    """Records the key its `apply` got; `reads_key` as given."""

    name: str
    log: dict = dataclasses.field(compare=False, hash=False)
    reading: bool = True

    @property
    def reads_key(self) -> bool:
        return self.reading

    def apply(self, params, x, *, key=None, **kwargs):
        self.log[self.name] = key
        return x


def test_keys_reach_only_the_layers_that_draw():
    """`call` folds a key for a sub-layer that draws (or holds one that does) and hands None to the rest; the keys
    a drawing layer gets do not depend on its neighbours drawing."""
    log: dict = {}
    rec = lambda n, reading=True: KeyRecorder(n, log, reading)  # noqa: E731
    key = random.key(3)
    drawing = Block(attn=rec("attn"), mlp=rec("mlp", False), ln_1=rec("ln_1", False), ln_2=rec("ln_2", False))
    assert drawing.draws and not drawing.reads_key and not rec("x", False).draws
    Stacked(drawing, 2).apply({}, _x(1, 3, D), key=key)
    assert log["mlp"] is None and log["ln_1"] is None and log["ln_2"] is None
    assert torch.equal(log["attn"], path_key(random.split(key, 2)[1], "attn"))  # the second layer's, folded by name
    quiet = Block(attn=rec("attn", False), mlp=rec("mlp", False), ln_1=rec("ln_1", False), ln_2=rec("ln_2", False))
    assert not quiet.draws and not Stacked(quiet, 2).draws
    log.clear()
    Stacked(quiet, 2).apply({}, _x(1, 3, D), key=key)
    assert log == {"attn": None, "mlp": None, "ln_1": None, "ln_2": None}
    assert not Stacked(_block(dropout=0.0), 2).draws and Stacked(_block(dropout=0.1), 2).draws


def test_builtin_layers_forward_kwargs(monkeypatch):
    """Every built-in leaf layer class sees a custom kwarg passed to the top-level apply."""
    seen: dict = {}
    for cls in (Linear, RMSNorm, RotaryEmbedding, Dropout):
        original = cls.apply

        def spy(self, params, x, *, key=None, _orig=original, _cls=cls.__name__, **kwargs):
            seen.setdefault(_cls, []).append(kwargs.get("marker"))
            return _orig(self, params, x, key=key, **kwargs)

        monkeypatch.setattr(cls, "apply", spy)
    model = Stacked(_block(dropout=0.1), 2)
    model.apply(model.init(random.key(0)), _x(1, 3, D), key=random.key(1), marker="m")
    assert set(seen) == {"Linear", "RMSNorm", "RotaryEmbedding", "Dropout"}
    assert all(v == "m" for calls in seen.values() for v in calls)
    assert len(seen["Linear"]) == 2 * 7  # per block: wq wk wv wo gate up down


MODEL_CASES = [  # (id, model, leaf layer classes it contains)
    ("gpt2", lambda: GPT2(GPT2Config(vocab_size=64, max_seq_len=8, n_layers=2, n_heads=2, d_model=16, dropout=0.1)),
     {"Embedding", "LayerNorm", "Linear", "Dropout", "CausalSelfAttention", "MLP", "Block"}),
    ("llama3_scan", lambda: Llama3(Llama3Config(vocab_size=64, max_seq_len=8, n_layers=2, n_heads=2, n_kv_heads=1,
                                               d_model=16, ffn_dim=32, scan_layers=True)),
     {"Embedding", "RMSNorm", "Linear", "RotaryEmbedding", "Attention", "SwiGLU", "Block"}),
]


@pytest.mark.parametrize("name,make_model,classes", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_model_kwargs_reach_every_layer_class(monkeypatch, name, make_model, classes):
    """A kwarg given to a whole model's apply is seen by every layer class inside it."""
    seen: dict = {}
    all_classes = (Linear, Embedding, LayerNorm, RMSNorm, RotaryEmbedding, Dropout, Attention, CausalSelfAttention,
                   MLP, SwiGLU, Block, LlamaBlock)
    for cls in all_classes:

        def spy(self, params, x, *, key=None, _orig=cls.apply, _cls=cls.__name__, **kwargs):
            seen.setdefault(_cls, []).append(kwargs.get("marker"))
            return _orig(self, params, x, key=key, **kwargs)

        monkeypatch.setattr(cls, "apply", spy)
    model = make_model()
    model.apply(model.init(random.key(0)), torch.zeros(1, 4, dtype=torch.long), key=random.key(1), marker="m")
    assert set(seen) == classes
    assert all(v == "m" for calls in seen.values() for v in calls)


# ------------------------------------------------------------------------------- errors


def test_param_validation():
    with pytest.raises(ValueError, match="axes must name every dimension"):
        Param((2, 3), init=inits.zeros(), axes=("embed",))
    with pytest.raises(TypeError, match="callable init"):
        Param((2,), init="zeros", axes=("embed",))
    with pytest.raises(ValueError, match="non-negative ints"):
        Param((2, -1), init=inits.zeros(), axes=(None, None))


def test_module_validation():
    with pytest.raises(ValueError, match="n_heads=3 does not divide d_model=16"):
        Attention(16, 3)
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=4"):
        Attention(16, 4, 3)
    with pytest.raises(ValueError, match="must be a positive even int"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="activation must be one of"):
        MLP(4, 8, activation="tanh")

    @dataclasses.dataclass(frozen=True)
    class Bad(Module):
        def declare(self):
            return {"a.b": Linear(2, 2)}

    with pytest.raises(ValueError, match="without '.'"):
        Bad()

    @dataclasses.dataclass(frozen=True)
    class Shadow(Module):
        init: int = 0

    with pytest.raises(TypeError, match="hides Module.init"):
        Shadow()


def test_initializer_returning_wrong_shape_names_the_path():
    bad = Param((3,), init=lambda key, shape, dtype: torch.zeros(4), axes=(None,))

    @dataclasses.dataclass(frozen=True)
    class Holder(Module):
        def declare(self):
            return {"w": bad}

    with pytest.raises(ValueError, match=r"parameter w returned \(4,\)"):
        Holder().init(random.key(0))


# ------------------------------------------------------------------------------- initializers


def test_initializers():
    k = random.key(0)
    n = inits.normal(0.02)(k, (200, 200), torch.float32)
    assert abs(n.std().item() - 0.02) < 1e-3 and abs(n.mean().item()) < 1e-3
    t = inits.truncated_normal(1.0)(k, (100_000,), torch.float32)
    assert t.abs().max().item() <= 2.0
    u = inits.uniform(-0.5, 0.5)(k, (1000,), torch.float32)
    assert u.min().item() >= -0.5 and u.max().item() < 0.5
    assert inits.ones()(k, (3,), torch.bfloat16).dtype == torch.bfloat16
    # LeCun: variance 1 / fan_in, torch layout (out, in) -> fan_in = shape[-1].
    w = inits.lecun_normal()(k, (256, 400), torch.float32)
    assert abs(w.var().item() * 400 - 1.0) < 0.05
    g = inits.glorot_uniform()(k, (300, 100), torch.float32)
    assert abs(g.var().item() * 200 - 1.0) < 0.05
    s = inits.scaled(inits.ones(), 0.5)(k, (2,), torch.float32)
    assert s.tolist() == [0.5, 0.5]
    assert inits.normal(0.02) == inits.normal(0.02) and hash(inits.zeros()) == hash(inits.zeros())
    with pytest.raises(ValueError, match="mode must be one of"):
        inits.variance_scaling(1.0, "fan_sideways")
