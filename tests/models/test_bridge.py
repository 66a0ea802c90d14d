"""`ember.models.bridge.from_torch`: torch modules trained by ember's pure step match torch.optim."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ember import optim
from ember.core import TrainState, pytree, random
from ember.core.step_fns import cross_entropy, train_step
from ember.core.testing import assert_trees_all_close, assert_trees_all_equal
from ember.models.bridge import HF_GPT2_AXES_RULES, HF_LLAMA_AXES_RULES, axes_from_rules, from_torch

transformers = pytest.importorskip("transformers")

STEPS = 10

# (id, ember transformation, torch.optim class, torch kwargs, params atol): same hyperparameters on both sides.
# Params tolerance: GPT-2's key bias (part of c_attn.bias) gets a gradient that is pure rounding noise
# (softmax is invariant to a shift shared by all keys), and Adam normalises that noise into lr-sized
# steps, so after 10 AdamW steps those entries differ by up to ~2e-5 while the losses agree to 1e-6.
OPTIMIZERS_UNDER_TEST = [
    ("adamw", lambda: optim.adamw(3e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01), torch.optim.AdamW,
     dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), 1e-4),
    ("sgd", lambda: optim.sgd(0.1, momentum=0.9), torch.optim.SGD, dict(lr=0.1, momentum=0.9), 1e-6),
]


def _tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _batches(n: int, *, vocab: int = 100, shape=(4, 16)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(n)]


def _torch_losses(module, opt_cls, opt_kw, batches, loss_of):
    opt = opt_cls(module.parameters(), **opt_kw)
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = loss_of(module, b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _ember_losses(model, params, tx, batches, loss_fn):
    state = TrainState.create(params=params, tx=tx, key=random.key(0))
    step = train_step(loss_fn)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"].item())
    return losses, state.params


@pytest.mark.parametrize("make_tx,opt_cls,opt_kw,params_atol", [c[1:] for c in OPTIMIZERS_UNDER_TEST],
                         ids=[c[0] for c in OPTIMIZERS_UNDER_TEST])
def test_hf_gpt2_trains_like_torch_optim(make_tx, opt_cls, opt_kw, params_atol):
    hf = _tiny_gpt2()
    reference = copy.deepcopy(hf).train()  # dropout probabilities are 0: train mode == eval mode
    model, params = from_torch(hf, axes_rules=HF_GPT2_AXES_RULES)
    batches = _batches(STEPS)

    def loss_fn(p, ids, *, key):  # ember's cross-entropy on shifted logits
        logits = model.apply(p, input_ids=ids, use_cache=False, key=key).logits  # (B, T, V)
        return cross_entropy(logits[:, :-1], ids[:, 1:])

    def torch_loss(m, ids):  # HF's own loss from labels (it shifts internally)
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    ours, trained = _ember_losses(model, params, make_tx(), batches, loss_fn)
    theirs = _torch_losses(reference, opt_cls, opt_kw, batches, torch_loss)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) < 1e-5, f"step {i}: ember loss {a} vs torch {b}"
    assert ours[-1] < ours[0]
    want = {n: p.detach() for n, p in reference.named_parameters()}
    got = dict(pytree.tree_leaves_with_path(trained))
    assert_trees_all_close(got, want, rtol=0.0, atol=params_atol)
    # the module itself was never written to by the functional steps
    assert_trees_all_equal(dict(pytree.tree_leaves_with_path(model.init())), dict(pytree.tree_leaves_with_path(params)))


def test_sequential_mlp_matches_torch():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    reference = copy.deepcopy(net)
    model, params = from_torch(net)
    assert list(params) == ["0", "2"] and list(params["0"]) == ["weight", "bias"]
    assert model.axes == {"0": {"weight": (None, None), "bias": (None,)}, "2": {"weight": (None, None), "bias": (None,)}}
    g = torch.Generator().manual_seed(3)
    batches = [{"x": torch.randn(8, 6, generator=g), "y": torch.randn(8, 3, generator=g)} for _ in range(5)]
    x = batches[0]["x"]
    assert torch.equal(model.apply(params, x), net(x))

    def loss_fn(p, b, *, key):
        return F.mse_loss(model.apply(p, b["x"], key=key), b["y"])

    ours, _ = _ember_losses(model, params, optim.sgd(0.05, momentum=0.9), batches, loss_fn)
    theirs = _torch_losses(reference, torch.optim.SGD, dict(lr=0.05, momentum=0.9), batches,
                           lambda m, b: F.mse_loss(m(b["x"]), b["y"]))
    assert ours == pytest.approx(theirs, abs=1e-6)


class _WithBuffers(torch.nn.Module):
    """A linear layer whose output is rescaled by a non-persistent buffer and shifted by a persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]), persistent=False)
        self.register_buffer("shift", torch.tensor([0.5, -0.5, 0.0]))

    def forward(self, x):
        return self.lin(x) * self.scale + self.shift


def test_buffers_are_constants_not_params():
    torch.manual_seed(0)
    module = _WithBuffers()
    model, params = from_torch(module)
    assert pytree.tree_paths(params) == ["lin.weight", "lin.bias"]
    assert sorted(model.buffers) == ["scale", "shift"]
    x = torch.randn(5, 4)
    assert torch.equal(model.apply(params, x), module(x))
    grads = torch.func.grad(lambda p: model.apply(p, x).sum())(params)
    assert torch.equal(grads["lin"]["bias"], torch.tensor([1.0, 2.0, 3.0]) * 5)  # d/db of sum(scale * (xW + b))
    # trained params go back into the module through a complete, strict state dict
    trained = pytree.tree_map(lambda t: t + 1.0, params)
    sd = model.state_dict(trained)
    assert sorted(sd) == sorted(module.state_dict())  # the non-persistent buffer is not in it
    fresh = _WithBuffers()
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), model.apply(trained, x))


def test_tied_weights_appear_once_and_export_under_every_name():
    hf = _tiny_gpt2()
    model, params = from_torch(hf, axes_rules=HF_GPT2_AXES_RULES)
    paths = pytree.tree_paths(params)
    assert "transformer.wte.weight" in paths and "lm_head.weight" not in paths
    ids = _batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model.apply(params, input_ids=ids).logits, hf(input_ids=ids).logits)
    sd = model.state_dict(params)
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    hf.load_state_dict(sd)  # strict


def test_hf_llama_rules_place_every_parameter():
    for tie in (False, True):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                                       bos_token_id=0, eos_token_id=0)
        model, params = from_torch(transformers.LlamaForCausalLM(cfg), axes_rules=HF_LLAMA_AXES_RULES)
        layer = model.axes["model"]["layers"]["0"]
        assert layer["self_attn"]["k_proj"]["weight"] == ("kv_heads", "embed")
        assert layer["mlp"]["down_proj"]["weight"] == ("embed", "mlp")
        assert model.axes["model"]["norm"]["weight"] == ("embed",)
        assert ("lm_head" in model.axes) != tie
        assert pytree.tree_structure(params) == pytree.tree_structure(model.param_shapes())


def test_hf_gpt2_rules_place_every_parameter():
    model, _ = from_torch(_tiny_gpt2(), axes_rules=HF_GPT2_AXES_RULES)
    block = model.axes["transformer"]["h"]["1"]
    assert block["attn"]["c_attn"]["weight"] == ("embed", None)
    assert block["attn"]["c_proj"] == {"weight": ("heads", "embed"), "bias": ("embed",)}
    assert block["mlp"]["c_fc"] == {"weight": ("embed", "mlp"), "bias": ("mlp",)}
    assert model.axes["transformer"]["wte"]["weight"] == ("vocab", "embed")
    bare, _ = from_torch(transformers.GPT2Model(_tiny_gpt2().config), axes_rules=HF_GPT2_AXES_RULES)  # no prefix
    assert bare.axes["ln_f"] == {"weight": ("embed",), "bias": ("embed",)}
    assert bare.axes["wpe"]["weight"] == (None, "embed")


def test_rule_that_leaves_a_parameter_unplaced():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    rules = [(r"weight$", ("mlp", "embed"))]
    with pytest.raises(ValueError, match=r"parameter '0\.bias' \(shape \(8,\)\) matches none of the axes rules(.|\n)*"
                                         r"0: \('weight\$', \('mlp', 'embed'\)\)(.|\n)*default_axes"):
        from_torch(net, axes_rules=rules)
    model, _ = from_torch(net, axes_rules=rules, default_axes="replicated")
    assert model.axes["2"] == {"weight": ("mlp", "embed"), "bias": (None,)}
    model, _ = from_torch(net, axes_rules=rules, default_axes=("mlp",))
    assert model.axes["0"]["bias"] == ("mlp",)


def test_rule_errors():
    shapes = {"fc.weight": (8, 4), "fc.bias": (8,)}
    with pytest.raises(ValueError, match=r"gives 2 axes to parameter 'fc\.bias' of shape \(8,\) \(1 dims\)"):
        axes_from_rules(shapes, [(r"fc", ("mlp", "embed"))])
    with pytest.raises(ValueError, match=r"default_axes \('a', 'b'\) has 2 axes but parameter 'fc\.bias'"):
        axes_from_rules(shapes, [(r"weight", ("mlp", "embed"))], default_axes=("a", "b"))
    with pytest.raises(TypeError, match=r"axes_rules\[0\] must be a \(regex: str, axes: tuple\) pair"):
        axes_from_rules(shapes, [("fc", ["mlp", "embed"])])
    with pytest.raises(ValueError, match=r"regex '\(' does not compile"):
        axes_from_rules(shapes, [("(", ("mlp",))])
    with pytest.raises(ValueError, match=r"default_axes must be a tuple, 'replicated' or None, got 'replicate'"):
        axes_from_rules(shapes, [], default_axes="replicate")
    with pytest.raises(TypeError, match=r"from_torch expects a torch\.nn\.Module"):
        from_torch(lambda x: x)


def test_params_must_match_the_module():
    model, params = from_torch(torch.nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"missing \['bias'\], unknown \['scale'\]"):
        model.apply({"weight": params["weight"], "scale": torch.ones(2)}, torch.ones(1, 3))


def test_eval_mode_flag():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()
    from_torch(net)
    assert not net.training and not net[1].training
    net.train()
    from_torch(net, eval_mode=False)
    assert net.training


@pytest.mark.parametrize("policy", ["full", "dots_saveable"])
def test_remat_of_hf_llama_blocks_gives_the_same_step(policy):
    # The decoder layers of a Hugging Face Llama run through ember's remat: eager and compiled
    # (Inductor) steps equal the plain bridge's, and the traced step recomputes each layer.
    from ember.core.jit import jit

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg)
    plain, params = from_torch(hf)
    rematted, _ = from_torch(hf, remat={r"model\.layers\.\d+": policy})

    def loss_of(model):
        def loss_fn(p, ids, *, key):
            logits = model.apply(p, input_ids=ids, use_cache=False).logits
            return cross_entropy(logits[:, :-1], ids[:, 1:])

        return loss_fn

    ids = _batches(1, vocab=64)[0]
    state = TrainState.create(params=params, tx=optim.sgd(0.1), key=random.key(0))
    want, want_metrics = train_step(loss_of(plain))(state, ids)
    for backend in ("eager", "inductor"):
        got, metrics = jit(train_step(loss_of(rematted)), backend=backend)(state, ids)
        assert_trees_all_close(got.params, want.params, rtol=1e-5, atol=1e-6)
        assert_trees_all_close(metrics["loss"], want_metrics["loss"], rtol=1e-6, atol=1e-6)
    assert "forward" not in hf.model.layers[0].__dict__  # the instances are as they were
    with pytest.raises(ValueError, match=r"remat'd submodule 'model.layers.0' got a DynamicCache .* use_cache=False"):
        rematted.apply(params, input_ids=ids, use_cache=True)


def test_remat_rules_that_match_nothing_or_name_no_policy():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"matches no submodule of Sequential \(it must match a whole dotted name; submodules: 0, 1\)"):
        from_torch(net, remat={r"layers\.\d+": "full"})
    with pytest.raises(ValueError, match=r"unknown remat policy 'ful'; did you mean 'full'"):
        from_torch(net, remat={r"\d": "ful"})
