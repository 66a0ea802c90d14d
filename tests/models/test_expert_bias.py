"""DeepSeek-V3's expert bias is sealed: the train step moves it by its load, whatever optimizer a script
builds, and nothing else (the gradient norm, the clip, weight decay, bfloat16 compute, a bfloat16 export) sees
or rounds it."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from ember import optim
from ember.core import TrainState, pytree, random
from ember.core.step_fns import StatisticLeaves, train_step
from ember.core.transforms import grad
from ember.core.tree_math import global_norm
from ember.models import build_model, lm_loss, to_hf

RATE = 0.01
BIAS = "expert_bias"


def _model(**overrides):
    config = dict(router="sigmoid", expert_bias=True, expert_bias_update_rate=RATE, router_aux_loss_coef=0.0)
    return build_model("qwen3_moe", "tiny", **{**config, **overrides})


def _batch(b=4, t=16):
    tokens = random.randint(random.key(2), (b, t), 0, 256)
    return {"inputs": tokens, "targets": tokens}


def _params(model):
    """Initial params with a non-zero bias (selection depends on it)."""
    return pytree.tree_map_with_path(
        lambda path, t: torch.linspace(-0.05, 0.05, t.numel()).view_as(t) if path.endswith(BIAS) else t,
        model.init(random.key(0)))


def _is_bias(path):
    return path.endswith(BIAS)


def _split(tree):
    """`(bias leaves, other leaves)` by path."""
    flat = pytree.tree_flatten_with_path(tree)[0]
    keyed = {pytree.keystr(p): t for p, t in flat}
    return ({k: t for k, t in keyed.items() if _is_bias(k)}, {k: t for k, t in keyed.items() if not _is_bias(k)})


def _loads_and_grads(model, params, batch):
    """The loss's gradients: the bias leaves' are the loads (token-normalised as the step normalises them)."""
    def loss(p):
        total = lm_loss(model)(p, batch, key=None)[0]
        return total.total / total.count
    return _split(grad(loss)(params))


@pytest.mark.parametrize("tx", ["adamw", "clip_adamw"])
def test_a_plain_optimizer_leaves_the_bias_to_its_rule_and_never_sees_its_loads(tx):
    model, batch = _model(), _batch()
    params = _params(model)
    tx = (optim.adamw(1e-3, weight_decay=0.1) if tx == "adamw"
          else optim.chain(optim.clip_by_global_norm(1e-3), optim.adamw(1e-3, weight_decay=0.1)))
    state = TrainState.create(params=params, tx=tx, key=random.key(1))
    new, metrics = train_step(lm_loss(model), tx)(state, batch)

    loads, grads = _loads_and_grads(model, params, batch)
    old_bias, _ = _split(params)
    new_bias, new_rest = _split(new.params)
    assert loads and all(b.dtype == torch.float32 for b in new_bias.values())
    for name, load in loads.items():  # busier than the mean: down by the rate; idler: up; the mean: still
        want = old_bias[name] - RATE * torch.sign(load - load.mean())
        torch.testing.assert_close(new_bias[name], want, rtol=0, atol=1e-7)
        assert (new_bias[name] != old_bias[name]).any()
    # the norm, the clip, the moments and the decay ran over the other leaves' gradients alone
    torch.testing.assert_close(metrics["grad_norm"], global_norm(grads), rtol=1e-5, atol=0)
    assert float(global_norm((grads, loads))) > 1.01 * float(metrics["grad_norm"])  # a leak would show
    zeroed = pytree.tree_map_with_path(lambda path, g: torch.zeros_like(g) if _is_bias(path) else g,
                                       grad(lambda p: lm_loss(model)(p, batch, key=None)[0].mean())(params))
    updates, _ = tx.update(zeroed, tx.init(params), params)
    _, want_rest = _split(optim.apply_updates(params, updates))
    for name, value in want_rest.items():
        torch.testing.assert_close(new_rest[name], value, rtol=1e-5, atol=1e-6)


def test_a_skipped_step_keeps_the_bias():
    model, batch = _model(), _batch()
    params = _params(model)
    state = TrainState.create(params=params, tx=optim.sgd(1e-3), key=random.key(1))

    def poisoned(p, b, *, key):
        loss, metrics = lm_loss(model)(p, b, key=key)
        return loss._replace(total=loss.total * float("nan")), metrics

    poisoned.statistic_leaves = lm_loss(model).statistic_leaves
    new, metrics = train_step(poisoned)(state, batch)
    assert float(metrics["skipped"]) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(new.params), pytree.tree_leaves(params)))


def test_microbatches_move_the_bias_as_one_batch_does():
    model, batch = _model(), _batch(b=4)
    state = TrainState.create(params=_params(model), tx=optim.adamw(1e-3), key=random.key(1))
    one, _ = train_step(lm_loss(model))(state, batch)
    two, _ = train_step(lm_loss(model), microbatches=2)(state, batch)
    assert all(torch.equal(a, b) for a, b in zip(_split(one.params)[0].values(), _split(two.params)[0].values()))


def test_the_bias_stays_float32_under_bfloat16_compute():
    model, batch = _model(), _batch()
    seen = {}

    def loss_fn(p, b, *, key):
        bias, rest = _split(p)
        seen.update(bias={t.dtype for t in bias.values()}, rest={t.dtype for t in rest.values()})
        return lm_loss(model)(p, b, key=key)

    loss_fn.statistic_leaves = lm_loss(model).statistic_leaves
    state = TrainState.create(params=_params(model), tx=optim.adamw(1e-3), key=random.key(1))
    new, _ = train_step(loss_fn, compute_dtype=torch.bfloat16)(state, batch)
    assert seen == {"bias": {torch.float32}, "rest": {torch.bfloat16}}
    old_bias, new_bias = _split(state.params)[0], _split(new.params)[0]
    for name, value in new_bias.items():  # steps of exactly the rate, on a float32 bias
        assert value.dtype == torch.float32
        step = (value - old_bias[name]).abs()
        assert ((step == 0) | ((step - RATE).abs() < 1e-6)).all() and (step > 0).any(), step


def test_a_bfloat16_export_keeps_the_bias_float32(tmp_path):
    model = build_model("dots1", "tiny")
    params = _params(model)
    to_hf(model, params, tmp_path, dtype=torch.bfloat16)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    biases = {k: v for k, v in dtypes.items() if k.endswith("e_score_correction_bias")}
    assert biases and set(biases.values()) == {"F32"}
    assert {v for k, v in dtypes.items() if k not in biases} == {"BF16"}
    assert json.load(open(os.path.join(tmp_path, "config.json")))["torch_dtype"] == "bfloat16"


def test_rate_zero_keeps_the_bias_and_a_bad_rate_is_refused():
    model, batch = _model(expert_bias_update_rate=0.0), _batch()
    state = TrainState.create(params=_params(model), tx=optim.adamw(1e-2, weight_decay=0.5), key=random.key(1))
    new, _ = train_step(lm_loss(model))(state, batch)
    assert all(torch.equal(a, b) for a, b in zip(_split(new.params)[0].values(), _split(state.params)[0].values()))
    from ember.models.layers.moe_router import expert_balance
    with pytest.raises(ValueError, match="expert_bias_update_rate must be a number >= 0"):
        expert_balance(-1.0)


def test_a_loss_function_with_a_wrong_rule_is_refused():
    model = _model()
    loss_fn = lambda p, b, *, key: lm_loss(model)(p, b, key=key)  # noqa: E731
    loss_fn.statistic_leaves = "expert_bias"
    with pytest.raises(TypeError, match="StatisticLeaves"):
        train_step(loss_fn, optim.sgd(0.1))
    assert isinstance(lm_loss(model).statistic_leaves, StatisticLeaves)
    assert lm_loss(_model(expert_bias=False, expert_bias_update_rate=0.0)).statistic_leaves is None


@pytest.mark.slow
def test_the_compiled_step_moves_the_bias_as_the_eager_step_does():
    """In ember's Inductor step (donated state): the eager step's bias bits."""
    from ember.core.jit import jit

    model, batch = _model(), _batch()
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1))
    state = TrainState.create(params=_params(model), tx=tx, key=random.key(1))
    eager_state, compiled_state = state, pytree.tree_map(torch.clone, state)
    step = train_step(lm_loss(model), tx)
    compiled = jit(step, backend="inductor", donate="state")
    for _ in range(2):
        eager_state, eager_metrics = step(eager_state, batch)
        compiled_state, metrics = compiled(compiled_state, batch)
    for (name, want), got in zip(_split(eager_state.params)[0].items(), _split(compiled_state.params)[0].values()):
        assert torch.equal(got, want), name
    torch.testing.assert_close(metrics["grad_norm"], eager_metrics["grad_norm"], rtol=1e-5, atol=0)


def test_the_removed_wrapper_names_the_fix():
    with pytest.raises(AttributeError, match="train_step moves the routers' expert biases .* pass the optimizer unwrapped"):
        optim.balance_experts(optim.adamw(1e-3), 1e-3)
    assert not hasattr(optim, "no_such_name")
