"""`ember.models.lora`: LoRA as a converter over (model, params), trained with ember's pure step."""

from __future__ import annotations

import math

import pytest
import torch

from ember import optim
from ember.core import TrainState, pytree, random
from ember.core.step_fns import train_step
from ember.core.testing import assert_trees_all_equal
from ember.models import Llama3, lm_loss
from ember.models.hf import from_hf, to_hf
from ember.models.lora import LoRAModel, lora_init, lora_mask, lora_targets, merge_lora, to_lora


def _clone(tree):
    return pytree.tree_map(lambda t: t.clone(), tree)


def _batch(cfg, *, b: int = 4, t: int = 16):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.mark.parametrize("scan_layers", [False, True], ids=["list", "scan"])
def test_converted_model_starts_equal_to_base(llama3_cfg, scan_layers):
    base = Llama3(llama3_cfg.replace(scan_layers=scan_layers))
    model = to_lora(base, rank=4, alpha=8.0, targets=("wq", "wv", "down"))
    params = model.init(random.key(0))
    assert_trees_all_equal(params["base"], base.init(random.split(random.key(0))[0]))
    tokens = _batch(llama3_cfg)["inputs"]
    assert torch.equal(model.apply(params, tokens), base.apply(params["base"], tokens))
    # factor shapes: A (r, in), B (out, r), with a leading (L,) for stacked layers
    attn = params["lora"]["blocks"]["attn"] if scan_layers else params["lora"]["blocks"][1]["attn"]
    lead = (llama3_cfg.n_layers,) if scan_layers else ()
    assert attn["wv"]["weight"]["a"].shape == (*lead, 4, 32)
    assert attn["wv"]["weight"]["b"].shape == (*lead, 16, 4)  # KV * D = 2 * 8
    assert "wk" not in attn


@pytest.mark.parametrize("scan_layers", [False, True], ids=["list", "scan"])
def test_lora_training_freezes_base(llama3_cfg, scan_layers):
    base = Llama3(llama3_cfg.replace(scan_layers=scan_layers))
    model = to_lora(base, rank=4, alpha=8.0, targets=("wq", "wv"))
    params = model.init(random.key(0))
    base_before, lora_before = _clone(params["base"]), _clone(params["lora"])
    tx = optim.masked(optim.adamw(1e-2, weight_decay=0.1), lora_mask(params))
    state = TrainState.create(params=params, tx=tx, key=random.key(1))
    step = train_step(lm_loss(model))
    batch = _batch(llama3_cfg)
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert_trees_all_equal(state.params["base"], base_before)  # bit-identical
    for path, (new, old) in zip(pytree.tree_paths(lora_before), zip(pytree.tree_leaves(state.params["lora"]),
                                                                     pytree.tree_leaves(lora_before))):
        assert not torch.equal(new, old), f"LoRA leaf {path} did not train"
    # the optimizer holds moments for the factors only
    n_lora = sum(t.numel() for t in pytree.tree_leaves(params["lora"]))
    n_state = sum(t.numel() for t in pytree.tree_leaves(state.opt_state) if t.dim() > 0)
    assert n_state == 2 * n_lora


def test_frozen_base_gets_zero_gradients(llama3_cfg):
    model = to_lora(Llama3(llama3_cfg), rank=2, targets=("wo",))
    params = model.init(random.key(0))
    params["lora"] = pytree.tree_map(lambda t: t + 0.1, params["lora"])  # make B nonzero
    batch = _batch(llama3_cfg)
    grads = torch.func.grad(lambda p: lm_loss(model)(p, batch, key=None).mean())(params)
    assert all(torch.count_nonzero(g) == 0 for g in pytree.tree_leaves(grads["base"]))
    assert all(torch.count_nonzero(g) > 0 for g in pytree.tree_leaves(grads["lora"]))
    unfrozen = to_lora(Llama3(llama3_cfg), rank=2, targets=("wo",), freeze_base=False)
    grads = torch.func.grad(lambda p: lm_loss(unfrozen)(p, batch, key=None).mean())(params)
    assert torch.count_nonzero(grads["base"]["wte"]["weight"]) > 0


def test_merged_export_equals_lora_logits(llama3_cfg, tmp_path):
    base = Llama3(llama3_cfg)
    model = to_lora(base, rank=4, alpha=16.0, targets=r"attn\.w[qkvo]|mlp\.up")
    params = model.init(random.key(0))
    params["lora"] = pytree.tree_map(lambda t: t + 0.05, params["lora"])  # a non-trivial adapter
    tokens = _batch(llama3_cfg)["inputs"]
    want = model.apply(params, tokens)
    assert not torch.allclose(want, base.apply(params["base"], tokens), atol=1e-3)
    merged = model.merged(params)
    assert torch.equal(base.apply(merged, tokens), want)
    to_hf(base, merged, tmp_path)
    back_model, back = from_hf(tmp_path, norm_eps=llama3_cfg.norm_eps)
    torch.testing.assert_close(back_model.apply(back, tokens), want, rtol=0, atol=1e-6)


def test_merge_math_and_scale():
    w = torch.randn(6, 5)
    a, b = torch.randn(3, 5), torch.randn(6, 3)
    got = merge_lora({"lin": {"weight": w, "bias": torch.zeros(6)}}, {"lin": {"weight": {"a": a, "b": b}}}, alpha=6.0)
    torch.testing.assert_close(got["lin"]["weight"], w + 2.0 * b @ a)  # alpha / r = 6 / 3
    with pytest.raises(ValueError, match=r"LoRA factors at 'lin\.weight' have shapes a=\(3, 4\)"):
        merge_lora({"lin": {"weight": w}}, {"lin": {"weight": {"a": torch.zeros(3, 4), "b": b}}}, alpha=1.0)
    with pytest.raises(ValueError, match=r"\['other'\] under '<root>', which the params lack"):
        merge_lora({"lin": {"weight": w}}, {"other": {"weight": {"a": a, "b": b}}}, alpha=1.0)


def test_lora_init_distribution_and_keys(llama3_cfg):
    params = Llama3(llama3_cfg).init(random.key(0))
    lora = lora_init(params, key=random.key(5), rank=8, targets=("gate",))
    a0, a1 = lora["blocks"]["mlp"]["gate"]["weight"]["a"]  # one per layer
    assert a0.abs().max() <= 1 / math.sqrt(32) and not torch.equal(a0, a1)
    assert torch.count_nonzero(lora["blocks"]["mlp"]["gate"]["weight"]["b"]) == 0
    assert_trees_all_equal(lora, lora_init(params, key=random.key(5), rank=8, targets=("gate",)))
    half = lora_init(params, key=random.key(5), rank=8, targets=("gate",), dtype=torch.bfloat16)
    assert {t.dtype for t in pytree.tree_leaves(half)} == {torch.bfloat16}


def test_axes_mirror_params(llama3_cfg):
    model = to_lora(Llama3(llama3_cfg.replace(scan_layers=True)), rank=2, targets=("wk", "down"))
    axes, shapes = model.axes, model.param_shapes()
    flat_axes = pytree.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    assert [len(a) for a in flat_axes] == [t.dim() for t in pytree.tree_leaves(shapes)]
    assert axes["lora"]["blocks"]["attn"]["wk"]["weight"] == {"a": ("layers", None, "embed"), "b": ("layers", "kv_heads", None)}
    assert axes["lora"]["blocks"]["mlp"]["down"]["weight"] == {"a": ("layers", None, "mlp"), "b": ("layers", "embed", None)}


def test_bridged_hf_llama_with_lora():
    transformers = pytest.importorskip("transformers")
    from ember.models.bridge import HF_LLAMA_AXES_RULES, from_torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0)
    base, base_params = from_torch(transformers.LlamaForCausalLM(cfg), axes_rules=HF_LLAMA_AXES_RULES)
    model = to_lora(base, rank=2, targets=("q_proj", "v_proj"))
    params = model.init_from(base_params, key=random.key(0))
    assert lora_targets(base_params, ("q_proj",)) == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)]
    ids = torch.randint(0, 64, (2, 8))
    assert torch.equal(model.apply(params, input_ids=ids).logits, base.apply(base_params, input_ids=ids).logits)
    assert model.axes["lora"]["model"]["layers"]["0"]["self_attn"]["q_proj"]["weight"] == {
        "a": (None, "embed"), "b": ("heads", None)}


def test_errors(llama3_cfg):
    base = Llama3(llama3_cfg)
    with pytest.raises(ValueError, match=r"targets \('q_proj',\) match no layer's `.weight` matrix(.|\n)*'wq'"):
        to_lora(base, targets=("q_proj",))
    with pytest.raises(ValueError, match=r"rank must be a positive int, got 0"):
        to_lora(base, rank=0)
    with pytest.raises(ValueError, match=r"alpha must be > 0"):
        to_lora(base, alpha=0.0)
    with pytest.raises(TypeError, match=r"non-empty tuple of layer names"):
        to_lora(base, targets=())
    with pytest.raises(TypeError, match=r"LoRAModel\.base must be a model with `init`"):
        LoRAModel(object())
    with pytest.raises(ValueError, match=r"lora_mask expects LoRAModel params \{'base': \.\.\., 'lora': \.\.\.\}, got \['wte'\]"):
        lora_mask({"wte": {}})
