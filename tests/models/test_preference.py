"""ember's preference step: log-probabilities, the reference, microbatches, compiled bits, bad input.

TRL parity is `test_preference_trl.py`; meshes `tests/partition_specs/test_dpo_meshes.py`; the command line
`tests/launch/test_dpo_run.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

from ember import optim
from ember.core import TrainState, TrainStateWithFrozen, jit, pytree, random
from ember.core.step_fns import chunked_token_logps, sequence_logps, token_logps, train_step
from ember.core.transforms import value_and_grad
from ember.core.tree_math import global_norm
from ember.data.preference import PreferencePairs, make_preference_pipeline, tokenize_preference_example
from ember.data.tokenizers import ByteTokenizer
from ember.models import DPOConfig, build_model, dpo_loss, lm_loss, to_lora
from ember.models.preference import response_logps

TINY = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16)


def _pairs(n=8, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = {}
    for side, end in (("chosen", seq), ("rejected", seq - 3)):
        ids = torch.randint(0, 64, (n, seq + 1), generator=g)
        targets = ids[:, 1:].clone()
        targets[:, :5] = -100
        targets[:, end:] = -100
        batch[f"{side}_inputs"], batch[f"{side}_targets"] = ids[:, :-1], targets
    return batch


@pytest.fixture(scope="module")
def model():
    return build_model("llama3", "tiny", **TINY)


@pytest.fixture(scope="module")
def params(model):
    return model.init(random.key(0))


def _moved(params, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    return pytree.tree_map(lambda t: t + scale * torch.randn(t.shape, generator=g), params)


def test_chunked_log_probs_equal_the_whole_head(model, params):
    chunked = build_model("llama3", "tiny", **TINY, loss_chunk_size=7)
    batch = _pairs()

    def total(m):
        def f(p):
            lp, _ = response_logps(m, p, batch["chosen_inputs"], batch["chosen_targets"])
            return (lp * torch.linspace(0.5, 2.0, lp.shape[1])).sum()  # not a sum: any function of them
        return value_and_grad(f)(params)

    (v1, g1), (v2, g2) = total(model), total(chunked)
    torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-6)
    for a, b in zip(pytree.tree_leaves(g1), pytree.tree_leaves(g2)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_lora_model_with_a_chunked_config_takes_the_whole_head(params):
    """`LoRAModel` merges its adapters in `apply` and has no `features`: its losses run the whole head (before,
    `lm_loss` of such a model raised `AttributeError: features`)."""
    chunked = to_lora(build_model("llama3", "tiny", **TINY, loss_chunk_size=7), rank=4, targets=("wq", "wv"))
    plain = to_lora(build_model("llama3", "tiny", **TINY), rank=4, targets=("wq", "wv"))
    lora_params = plain.init_from(params, key=random.key(3))
    batch = {"inputs": _pairs()["chosen_inputs"], "targets": _pairs()["chosen_targets"]}
    a, b = lm_loss(chunked)(lora_params, batch, key=None), lm_loss(plain)(lora_params, batch, key=None)
    assert torch.equal(a.total, b.total) and torch.equal(a.count, b.count)


def test_chunked_token_logps_is_remat_per_chunk():
    h, w = torch.randn(10, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 4, 5, -100, 1, 2, 3])
    ours = chunked_token_logps(lambda p, x: x @ p.T, w, h, y, chunk_size=3)
    torch.testing.assert_close(ours, token_logps(h @ w.T, y))
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        chunked_token_logps(lambda p, x: x @ p.T, w, h, y, chunk_size=0)


def test_packed_segments_sum_each_sequence_alone():
    lp = torch.tensor([[-1.0, -2.0, -3.0, -4.0, 0.0], [-5.0, -6.0, 0.0, 0.0, 0.0]])
    y = torch.tensor([[1, 1, -100, 1, -100], [1, 1, -100, -100, -100]])
    seg = torch.tensor([[1, 1, 2, 2, 0], [1, 1, 0, 0, 0]])
    out = sequence_logps(lp, y, segment_ids=seg, num_segments=2)
    assert out.total.tolist() == [[-3.0, -4.0], [-11.0, 0.0]] and out.count.tolist() == [[2, 1], [2, 0]]
    with pytest.raises(ValueError, match="num_segments"):
        sequence_logps(lp, y, segment_ids=seg)


def test_the_first_step_from_the_reference_has_the_exact_gradient(model, params):
    """A run starts with the policy equal to its reference: every margin is exactly 0, where log sigmoid's
    gradient is 1/2 (a `relu` / `abs` form of it gives 0 there, and the first step would not move)."""
    batch, beta = _pairs(), 0.5
    loss_fn = dpo_loss(model, beta=beta)
    _, grads = value_and_grad(lambda p: loss_fn(p, batch, key=None, frozen=params)[0].total)(params)
    inputs = torch.cat([batch["chosen_inputs"], batch["rejected_inputs"]])
    targets = torch.cat([batch["chosen_targets"], batch["rejected_targets"]])

    def margin(p):  # the sum over pairs of chosen minus rejected log-probabilities
        total = sequence_logps(response_logps(model, p, inputs, targets)[0], targets).total
        return (total[:8] - total[8:]).sum()

    expected = value_and_grad(margin)(params)[1]
    for a, b in zip(pytree.tree_leaves(grads), pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, -beta / 2 * b, atol=1e-6, rtol=1e-5)
    assert float(global_norm(grads)) > 0


def _state(model, params, frozen=True, tx=None):
    tx = tx or optim.adamw(1e-2, weight_decay=0.1)
    if not frozen:
        return TrainState.create(params=params, tx=tx, key=random.key(1))
    return TrainStateWithFrozen.create(params=_moved(params), tx=tx, key=random.key(1),
                                       frozen=pytree.tree_map(torch.clone, params))


def test_the_reference_gets_no_gradient_no_state_and_no_update(model, params):
    state = _state(model, params)
    plain = TrainState.create(params=state.params, tx=state.tx, key=state.key)
    assert len(pytree.tree_leaves(state.opt_state)) == len(pytree.tree_leaves(plain.opt_state))  # no moments for it
    loss_fn, batch = dpo_loss(model), _pairs()
    new, metrics = train_step(loss_fn)(state, batch)
    grads = value_and_grad(lambda p: loss_fn(p, batch, key=None, frozen=state.frozen)[0].total / 8)(state.params)[1]
    torch.testing.assert_close(metrics["grad_norm"], global_norm(grads))  # the policy's gradient alone
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(new.frozen), pytree.tree_leaves(state.frozen)))
    assert not any(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(new.params), pytree.tree_leaves(state.params))
                   if a.dim() > 1)
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "identical_pairs", "loss", "grad_norm", "lr", "tokens"} <= set(metrics)
    assert float(metrics["tokens"]) == 8  # pairs


def test_precomputed_reference_log_probs_give_the_same_step(model, params):
    state, batch = _state(model, params), _pairs()
    inputs = torch.cat([batch["chosen_inputs"], batch["rejected_inputs"]])
    targets = torch.cat([batch["chosen_targets"], batch["rejected_targets"]])
    with torch.no_grad():
        ref = sequence_logps(response_logps(model, state.frozen, inputs, targets)[0], targets).total
    plain = TrainState.create(params=state.params, tx=state.tx, key=state.key)
    a, ma = train_step(dpo_loss(model))(state, batch)
    b, mb = train_step(dpo_loss(model))(plain, {**batch, "ref_chosen_logps": ref[:8], "ref_rejected_logps": ref[8:]})
    assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), abs=1e-6)
    for x, y in zip(pytree.tree_leaves(a.params), pytree.tree_leaves(b.params)):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss", ["sigmoid", "orpo"])
def test_four_microbatches_equal_one(model, params, loss):
    batch, sgd = _pairs(), optim.sgd(1.0)  # the update is the gradient (Adam's would amplify rounding near 0)
    one, m1 = train_step(dpo_loss(model, loss=loss))(_state(model, params, tx=sgd), batch)
    four, m4 = train_step(dpo_loss(model, loss=loss), microbatches=4)(_state(model, params, tx=sgd), batch)
    assert float(m1["loss"]) == pytest.approx(float(m4["loss"]), abs=2e-6) and float(m4["tokens"]) == 8
    for a, b in zip(pytree.tree_leaves(one.params), pytree.tree_leaves(four.params)):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)


@pytest.mark.slow
def test_compiled_step_repeats_its_bits_and_compiles_once(model, params):
    step = jit(train_step(dpo_loss(model)), backend="inductor")
    state, batch = _state(model, params), _pairs()
    (a, ma), (b, mb) = step(state, batch), step(state, batch)
    assert step.compile_count == 1
    assert all(torch.equal(x, y) for x, y in zip(pytree.tree_leaves((a, ma)), pytree.tree_leaves((b, mb))))
    eager, _ = train_step(dpo_loss(model))(state, batch)
    for x, y in zip(pytree.tree_leaves(a.params), pytree.tree_leaves(eager.params)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_a_lora_policy_has_no_second_copy_of_the_base(model, params):
    lora = to_lora(model, rank=4, targets=("wq", "wv"))
    lora_params = lora.init_from(params, key=random.key(3))
    state = TrainState.create(params=lora_params, tx=optim.masked(optim.adamw(1e-2), {
        "base": pytree.tree_map(lambda _: False, params), "lora": pytree.tree_map(lambda _: True, lora_params["lora"])}))
    assert not DPOConfig().needs_reference(lora) and DPOConfig().needs_reference(model)
    new, metrics = train_step(dpo_loss(lora))(state, _pairs())
    assert float(metrics["loss"]) == pytest.approx(0.6931, abs=1e-4)  # B = 0: the policy is its base at first
    assert float(metrics["grad_norm"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(new.params["base"]), pytree.tree_leaves(params)))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_mixture_of_experts_adds_its_router_losses(family):
    moe = build_model(family, "tiny", vocab_size=64, max_seq_len=16)
    params = moe.init(random.key(0))
    state = TrainStateWithFrozen.create(params=_moved(params), tx=optim.sgd(0.1), frozen=params)
    new, metrics = train_step(dpo_loss(moe))(state, _pairs())
    assert any(k.startswith("moe_") for k in metrics) and bool(torch.isfinite(metrics["loss"]))
    assert float(metrics["skipped"]) == 0.0


def test_identical_pairs_are_allowed_and_counted(model, params):
    batch = _pairs()
    for key in ("inputs", "targets"):
        batch[f"rejected_{key}"][:2] = batch[f"chosen_{key}"][:2]
    _, metrics = train_step(dpo_loss(model))(_state(model, params), batch)
    assert float(metrics["identical_pairs"]) == 0.25


def test_bad_objectives_name_the_fix(model, params):
    with pytest.raises(ValueError, match=r"unknown preference loss 'sigmod'.*Did you mean 'sigmoid'"):
        dpo_loss(model, loss="sigmod")
    with pytest.raises(ValueError, match="--dpo.loss: unknown preference loss 'dpo'"):
        DPOConfig(loss="dpo")
    with pytest.raises(ValueError, match="there is none: hold one in the state"):
        dpo_loss(model)(params, _pairs(), key=None)
    other = build_model("llama3", "tiny", **dict(TINY, d_model=48)).init(random.key(0))
    with pytest.raises(ValueError, match="does not match the policy's architecture.*--init_from"):
        dpo_loss(model)(params, _pairs(), key=None, frozen=other)
    with pytest.raises(KeyError, match="the batch lacks"):
        dpo_loss(model)(params, {"inputs": torch.zeros(2, 4, dtype=torch.long)}, key=None, frozen=params)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_preference_data_refuses_bad_rows_in_one_line(tmp_path):
    tok = ByteTokenizer(eos=True)
    good = {"prompt": "Q?", "chosen": "yes", "rejected": "no"}
    cases = [
        ({"prompt": "Q?", "chosen": "yes"}, r"prefs.jsonl:2: a preference example needs .* lacks 'rejected'"),
        ({"prompt": "Q?", "chosen": "", "rejected": "no"}, r"prefs.jsonl:2: the chosen response is empty"),
        ({"prompt": "Q?", "chosen": "yes", "rejected": [{"role": "assistant", "content": "no"}]},
         r"prefs.jsonl:2: prompt, chosen and rejected must all be strings"),
        ({"prompt": "x" * 40, "chosen": "yes", "rejected": "no"},
         r"prefs.jsonl:2: the prompt alone is 40 tokens.*raise --data.seq_len"),
    ]
    for row, match in cases:
        path = _write(tmp_path / "prefs.jsonl", [good, row])
        with pytest.raises(ValueError, match=match) as err:
            make_preference_pipeline(path, tokenizer=tok, seq_len=32, batch_size=1)
        assert "\n" not in str(err.value)


def test_pairs_keep_together_and_long_ones_are_cut_or_refused(tmp_path, caplog):
    tok = ByteTokenizer(eos=True)
    rows = [{"prompt": f"Q{i}:", "chosen": " yes" * (i + 1), "rejected": " no"} for i in range(6)]
    examples = [tokenize_preference_example(r, tok) for r in rows]
    pairs = PreferencePairs(examples, 12)
    assert "cut at the window's end" in caplog.text
    batch = pairs.gather([0, 5])
    assert set(batch) == {"chosen_inputs", "chosen_targets", "rejected_inputs", "rejected_targets"}
    assert (batch["chosen_inputs"][:, :3] == batch["rejected_inputs"][:, :3]).all()  # one prompt per row, both sides
    with pytest.raises(ValueError, match=r"examples\[2\]: 16 tokens.*--data.overflow truncate"):
        PreferencePairs(examples, 12, overflow="error")
    it = make_preference_pipeline(_write(tmp_path / "p.jsonl", rows), tokenizer=tok, seq_len=32, batch_size=2, seed=3)
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    more = [next(it) for _ in range(2)]
    again = make_preference_pipeline(str(tmp_path / "p.jsonl"), tokenizer=tok, seq_len=32, batch_size=2, seed=3)
    again.set_state(state)
    assert all((a[k] == b[k]).all() for a, b in zip(more, [next(again) for _ in range(2)]) for k in a)
    assert len(first) == 3
