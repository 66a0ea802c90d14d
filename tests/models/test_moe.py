"""The mixture-of-experts layer: routing, static dispatch, router losses, the expert bias, the compiled step."""

import pytest
import torch

from ember import optim
from ember.core import TrainState, pytree, random
from ember.core.jit import jit
from ember.core.step_fns import train_step
from ember.core.transforms import grad
from ember.models import build_model, get_config, lm_loss
from ember.models.layers.moe import MoE, router_losses
from ember.models.layers.moe_dispatch import assign_slots, combine, dispatch, expert_capacity
from ember.models.layers.moe_router import Router, bias_signal

D, E, I = 8, 6, 4


def _naive_moe(moe: MoE, params, x):
    """Token by token: every chosen expert's SwiGLU, weighted (no capacity)."""
    B, T, _ = x.shape
    routing = moe.router.apply(params["router"], x.reshape(B * T, D))
    out = torch.zeros(B * T, D)
    for n, token in enumerate(x.reshape(B * T, D)):
        for j in range(moe.router.top_k):
            e = int(routing.indices[n, j])
            h = torch.nn.functional.silu(params["gate"][e] @ token) * (params["up"][e] @ token)
            out[n] += routing.weights[n, j] * (params["down"][e] @ h)
    return out.view(B, T, D)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("style", ["softmax", "sigmoid"])
def test_dropless_layer_equals_token_by_token_experts(k, style):
    router = Router(D, E, k, style=style, renormalize=k > 1, n_groups=2 if style == "sigmoid" else 1,
                    expert_bias=style == "sigmoid", scaling=2.5 if style == "sigmoid" else 1.0)
    moe = MoE(router, I)
    params = moe.init(random.key(0))
    if style == "sigmoid":
        params["router"]["expert_bias"] = torch.randn(E) * 0.1
    x = torch.randn(2, 5, D)
    y, stats = moe.apply(params, x)
    torch.testing.assert_close(y, _naive_moe(moe, params, x), rtol=1e-5, atol=1e-6)
    assert float(stats["dropped"]) == 0 and float(stats["pairs"]) == 10 * k and float(stats["counts"].sum()) == 10 * k


def test_capacity_keeps_first_choices_before_second_choices_and_counts_drops():
    # one group of 3 tokens, k=2: every token's first choice is expert 0, second choice expert 1
    idx = torch.tensor([[[0, 1], [0, 1], [1, 0]]])
    s = assign_slots(idx, n_experts=2, capacity=2)
    # first choices in token order take expert 0's two slots (tokens 0, 1) and expert 1's first (token 2);
    # then second choices: token 0 -> expert 1 slot 1, token 1 -> expert 1 full (dropped), token 2 -> expert 0 full
    assert s.slot.tolist() == [[0, 1, 2, 3, 4, 4]]
    assert int(s.dropped) == 2 and s.counts.tolist() == [[3.0, 3.0]]
    assert s.source.tolist() == [[0, 1, 2, 0]]
    x = torch.arange(3.0).view(1, 3, 1).expand(1, 3, 2)
    buf = dispatch(x, s, 2, 2)
    assert buf[0, :, :, 0].tolist() == [[0.0, 1.0], [2.0, 0.0]]
    back = combine(buf, s, torch.ones(1, 3, 2))
    assert back[0, :, 0].tolist() == [0.0 + 0.0, 1.0, 2.0]  # token 0 twice (0 + 0); drops add nothing


def test_expert_capacity():
    assert expert_capacity(16, 2, 8, None) == 16  # dropless: a token picks an expert at most once
    assert expert_capacity(16, 2, 8, 1.0) == 4 and expert_capacity(16, 2, 8, 1.25) == 5
    assert expert_capacity(16, 2, 8, 100.0) == 16 and expert_capacity(1, 2, 8, 1.0) == 1


def test_group_limited_routing_picks_within_the_best_groups():
    router = Router(4, 4, 2, style="sigmoid", n_groups=2, topk_groups=1)
    # token: experts 0, 1 (group 0) score 0.6, 0.6; experts 2, 3 (group 1) 0.9, 0.1 -> group 0 wins (1.2 > 1.0)
    logits = torch.logit(torch.tensor([[0.6, 0.6, 0.9, 0.1]]))
    assert sorted(router._sigmoid_choice(torch.sigmoid(logits), None)[0].tolist()) == [0, 1]
    # a bias on expert 3 lifts group 1 (0.9 + 0.1 + 0.5 = 1.5) and the pick, not the weight
    chosen = router._sigmoid_choice(torch.sigmoid(logits), torch.tensor([0.0, 0.0, 0.0, 0.5]))
    assert sorted(chosen[0].tolist()) == [2, 3]


def test_bias_signal_is_zero_with_the_loads_as_gradient():
    counts = torch.tensor([3.0, 0.0, 5.0])
    bias = torch.zeros(3)
    assert float(bias_signal(bias, counts)) == 0.0
    assert grad(lambda b: bias_signal(b, counts))(bias).tolist() == counts.tolist()


def test_aux_loss_is_transformers_pooled_load_balancing_loss():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = build_model("qwen3_moe", "tiny", n_layers=3, n_experts=6, experts_per_token=2)
    params, tokens = model.init(random.key(0)), random.randint(random.key(1), (2, 9), 0, 256)
    logits = []
    router_apply = Router.apply

    def recording(self, p, x, **kw):
        out = router_apply(self, p, x, **kw)
        logits.append(out.logits)
        return out

    Router.apply = recording
    try:
        _, stats = model.features_and_extras(params, tokens)
    finally:
        Router.apply = router_apply
    want = load_balancing_loss_func(tuple(logits), 6, 2)
    aux, _, metrics = router_losses(stats, 6)
    torch.testing.assert_close(aux, want, rtol=0, atol=1e-6)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding leaves the stats, as in transformers
    logits.clear()
    Router.apply = recording
    try:
        _, masked = model.features_and_extras(params, tokens, attention_mask=mask)
    finally:
        Router.apply = router_apply
    torch.testing.assert_close(router_losses(masked, 6)[0], load_balancing_loss_func(tuple(logits), 6, 2, mask),
                               rtol=0, atol=1e-6)
    assert set(metrics) == {"moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_max_load"}
    del transformers


def test_scan_layers_and_remat_compute_what_the_list_of_blocks_computes():
    base = get_config("qwen3_moe", "tiny").replace(n_layers=3, capacity_factor=1.0)
    listed = build_model("qwen3_moe", "tiny", **{f: getattr(base, f) for f in ("n_layers", "capacity_factor")},
                         scan_layers=False)
    stacked = build_model("qwen3_moe", "tiny", n_layers=3, capacity_factor=1.0, remat="full")
    from ember.core.transforms import stack_trees

    params = listed.init(random.key(0))
    stacked_params = dict(params, blocks=stack_trees(params["blocks"]))
    tokens = random.randint(random.key(1), (2, 12), 0, 256)
    (h1, s1), (h2, s2) = listed.features_and_extras(params, tokens), stacked.features_and_extras(stacked_params, tokens)
    torch.testing.assert_close(h2, h1)
    torch.testing.assert_close(s2, s1)
    g1 = grad(lambda p: lm_loss(listed)(p, {"inputs": tokens, "targets": tokens}, key=None)[0].mean())(params)
    g2 = grad(lambda p: lm_loss(stacked)(p, {"inputs": tokens, "targets": tokens}, key=None)[0].mean())(stacked_params)
    torch.testing.assert_close(g2["blocks"], stack_trees(g1["blocks"]), rtol=1e-5, atol=1e-6)


def test_scan_layers_rolls_in_the_compiled_step():
    # The router statistics ride along with the activations as a tree carry: one scan node each
    # way per run of equal blocks (two dense, then three MoE), and the gradients of the list of
    # blocks. An all-MoE stack is `_remat_scan_parity.py`'s qwen3_moe family.
    from _graphs import scan_nodes

    from ember.core.transforms import value_and_grad

    shape = dict(n_layers=5, capacity_factor=1.0, first_dense_layers=2)
    listed = build_model("qwen3_moe", "tiny", **shape, scan_layers=False)
    stacked = build_model("qwen3_moe", "tiny", **shape, remat="full")
    params = listed.init(random.key(0))
    blocks = stacked.children["blocks"]
    stacked_params = dict(params, blocks=blocks.stack(params["blocks"]))
    assert torch.equal(stacked.init(random.key(0))["wte"]["weight"], params["wte"]["weight"])
    assert all(torch.equal(a, b) for a, b in zip(
        torch.utils._pytree.tree_leaves(stacked.init(random.key(0))["blocks"]),
        torch.utils._pytree.tree_leaves(stacked_params["blocks"])))  # same init, layer by layer
    tokens = random.randint(random.key(1), (2, 12), 0, 256)
    batch = {"inputs": tokens, "targets": tokens}
    loss = lambda model: lambda p: lm_loss(model)(p, batch, key=None)[0].mean()  # noqa: E731
    value, grads = jit(value_and_grad(loss(stacked)))(stacked_params)
    assert scan_nodes(value_and_grad(loss(stacked)), stacked_params) == 4  # a forward and a backward per run
    want_value, want = value_and_grad(loss(listed))(params)
    torch.testing.assert_close(value, want_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blocks.unstack(grads["blocks"]), want["blocks"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("marked_by", ["segment_ids", "attention_mask"])
def test_padding_changes_no_moe_statistic_and_takes_no_capacity_slot(marked_by):
    """Left padding goes first in slot order: if it took slots, the document's drops would change with it."""
    model = build_model("qwen3_moe", "tiny", capacity_factor=1.0, router_z_loss_coef=1e-3, router="sigmoid",
                        expert_bias=True)
    params = pytree.tree_map_with_path(lambda path, t: torch.randn_like(t) * 0.1 if path.endswith("expert_bias")
                                       else t, model.init(random.key(0)))
    pad, T = 6, 16
    doc = random.randint(random.key(1), (1, T - pad), 0, 256)
    real = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, T - pad, dtype=torch.long)], 1)

    def run(seed, marked=True):
        inputs = torch.cat([random.randint(random.key(seed), (1, pad), 0, 256), doc], 1)
        batch = {"inputs": inputs, "targets": torch.where(real.bool(), inputs, -100)}
        if marked:
            batch[marked_by] = real
        loss, metrics = lm_loss(model)(params, batch, key=None)
        loads = grad(lambda p: lm_loss(model)(p, batch, key=None)[0].total)(params)
        biases = list(loads["blocks"]["mlp"]["router"]["expert_bias"])  # one per layer
        return loss.total, metrics, biases

    (loss_a, metrics_a, loads_a), (loss_b, metrics_b, loads_b) = run(3), run(4)
    assert float(metrics_a["moe_dropped"]) > 0  # the capacity binds
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(metrics_a, metrics_b, rtol=1e-6, atol=1e-7)
    for a, b in zip(loads_a, loads_b):
        assert torch.equal(a, b) and float(a.sum()) == (T - pad) * model.config.experts_per_token
    unmarked_a, unmarked_b = run(3, marked=False)[1], run(4, marked=False)[1]
    assert any(not torch.equal(unmarked_a[k], unmarked_b[k]) for k in unmarked_a)  # unmarked, the padding shows


@pytest.mark.slow
def test_compiled_step_compiles_once_over_20_steps_of_changing_routing():
    """No host sync: the Inductor path traces on fake tensors, where reading a value is an error."""
    model = build_model("qwen3_moe", "tiny", capacity_factor=1.0, router_z_loss_coef=1e-3)
    tx = optim.adamw(1e-2)
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))
    step = jit(train_step(lm_loss(model), tx), backend="inductor")
    tokens = random.randint(random.key(2), (20, 2, 17), 0, 256)
    loads = []
    for t in tokens:
        state, metrics = step(state, {"inputs": t[:, :-1], "targets": t[:, 1:]})
        loads.append((float(metrics["moe_max_load"]), float(metrics["moe_dropped"])))
    assert step.compile_count == 1
    assert len(set(loads)) > 10, loads  # routing changed from step to step


def test_chunked_loss_and_lora_keep_the_router_losses():
    from ember.models import to_lora

    model = build_model("qwen3_moe", "tiny", router_aux_loss_coef=0.5)
    params, tokens = model.init(random.key(0)), random.randint(random.key(1), (2, 17), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss, metrics = lm_loss(model)(params, batch, key=None)
    chunked, chunked_metrics = lm_loss(build_model("qwen3_moe", "tiny", router_aux_loss_coef=0.5,
                                                   loss_chunk_size=8))(params, batch, key=None)
    torch.testing.assert_close(chunked.mean(), loss.mean())
    torch.testing.assert_close(chunked_metrics, metrics)
    lora = to_lora(model, targets=("wq", "wv"))
    lora_params = lora.init_from(params, key=random.key(2))  # b = 0: the adapted model is the base
    lora_loss, lora_metrics = lm_loss(lora)(lora_params, batch, key=None)
    torch.testing.assert_close(lora_loss.mean(), loss.mean())
    assert float(metrics["moe_aux_loss"]) > 0 and lora_metrics.keys() == metrics.keys()


def test_greedy_decoding_with_a_kv_cache_matches_the_full_forward():
    from ember.models import Decoder

    model = build_model("qwen3_moe", "tiny")  # dropless: a decoding step routes as the full forward does
    params, prompt = model.init(random.key(0)), random.randint(random.key(1), (1, 5), 0, 256)
    out = Decoder(model).generate(params, prompt, max_new_tokens=6, temperature=0.0)
    tokens = prompt
    for _ in range(6):
        nxt = model.apply(params, tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    assert out.tolist() == tokens.tolist()


def test_decoding_is_dropless_whatever_the_capacity_factor():
    """Prefill and steps through the cache give the dropless full forward's logits (a step sees one token, so
    capacity, a training budget, could not drop there what a full forward drops)."""
    from ember.models.generation import decode_step, init_cache, prefill

    model = build_model("qwen3_moe", "tiny", capacity_factor=0.5, scan_layers=False)  # prefill runs a list
    dropless = build_model("qwen3_moe", "tiny", scan_layers=False)
    params, tokens = model.init(random.key(0)), random.randint(random.key(1), (1, 14), 0, 256)
    assert float(lm_loss(model)(params, {"inputs": tokens, "targets": tokens}, key=None)[1]["moe_dropped"]) > 0
    cache, logits = prefill(model, init_cache(model, batch=1, slots=14), params, tokens[:, :12])
    torch.testing.assert_close(logits, dropless.apply(params, tokens[:, :12])[:, -1], rtol=1e-5, atol=1e-5)
    for t in (12, 13):
        cache, logits = decode_step(model, cache, params, tokens[:, t], torch.tensor(t))
        torch.testing.assert_close(logits, dropless.apply(params, tokens[:, : t + 1])[:, -1], rtol=1e-5, atol=1e-5)
