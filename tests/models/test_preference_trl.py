"""ember's preference losses against TRL's: loss, metrics and every parameter's gradient.

Everything is local: `launch/tiny_chat.py` writes tiny Qwen2 and Llama folders (random init, a
byte-level BPE trained here, a ChatML template whose prompt / response boundary is not trivial);
TRL tokenizes the pairs with that template and collates them. The DPO losses run through
`DPOTrainer._compute_loss` (the policy and a reference copy from the same folder, the policy moved
off the reference); SimPO and ORPO through TRL's CPO and ORPO loss functions applied to log-probs of
transformers' forward. ember sees the same token ids as a pair batch and computes everything itself.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("trl")

from ember.core import pytree, random  # noqa: E402
from ember.core.step_fns import sequence_logps  # noqa: E402
from ember.core.transforms import value_and_grad  # noqa: E402
from ember.models import dpo_loss, from_hf, params_to_hf, response_logps, to_lora  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("preference_trl")]

PAIRS = [
    ("What is the json module for?", "Encoding and decoding JSON.", "Nothing at all, really, it is empty."),
    ("What is os for?", "Operating system interfaces.", "A fruit."),
    ("What does re do?", "Regular expressions.", "Regular expressions."),  # identical: allowed
]
TOL = 1e-5


CHAT_ROWS = [{"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
              "rejected": [{"role": "assistant", "content": r}]} for p, c, r in PAIRS]
TEXT_ROWS = [{"prompt": f"Q: {p}\nA:", "chosen": f" {c}", "rejected": f" {r}"} for p, c, r in PAIRS]


def _trl_trainer(folder, tmp, rows):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(folder)
    args = DPOConfig(output_dir=str(tmp), report_to="none", use_cpu=True, bf16=False)
    return DPOTrainer(model=_hf(folder), ref_model=_hf(folder), args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=tok)


def _trl_batch(folder, tmp):
    """TRL's collated batch of the chat pairs, in the dataset's order."""
    trainer = _trl_trainer(folder, tmp, CHAT_ROWS)
    return trainer.data_collator([trainer.train_dataset[i] for i in range(len(CHAT_ROWS))])


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")


def _ember_batch(trl_batch):
    """TRL's [chosen; rejected] rows as an ember pair batch: targets shifted once, -100 off the completion."""
    ids, mask = trl_batch["input_ids"], trl_batch["completion_mask"]
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    b = ids.shape[0] // 2
    return {"chosen_inputs": ids[:b], "chosen_targets": targets[:b],
            "rejected_inputs": ids[b:], "rejected_targets": targets[b:]}


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def case(request, tmp_path_factory):
    from ember.launch.tiny_chat import build

    tmp = tmp_path_factory.mktemp(request.param)
    folder = build(str(tmp), family=request.param)
    model, ref_params = from_hf(folder)
    gen = torch.Generator().manual_seed(1)
    policy = pytree.tree_map(lambda t: t + 0.02 * torch.randn(t.shape, generator=gen), ref_params)
    return types.SimpleNamespace(folder=folder, model=model, ref=ref_params, policy=policy, tmp=tmp,
                                 trl_batch=_trl_batch(folder, tmp / "trl"))


def _hf_policy(case):
    hf = _hf(case.folder)
    missing, unexpected = hf.load_state_dict(params_to_hf(case.policy, case.model.config), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    hf.train()
    return hf


def _ember(case, params, loss_fn, batch, **kw):
    (value, metrics), grads = value_and_grad(lambda p: _mean(loss_fn(p, batch, key=None, **kw)), has_aux=True)(params)
    return value, metrics, grads


def _mean(out):
    loss, metrics = out
    return loss.total / loss.count, metrics


def _assert_grads_equal(case, grads, hf):
    ours = params_to_hf(grads, case.model.config)
    named = dict(hf.named_parameters())
    assert set(ours) <= set(named) and len(ours) >= len(named) - 1  # all but a tied head
    for name, g in ours.items():
        torch.testing.assert_close(g, named[name].grad, atol=TOL, rtol=TOL, msg=lambda m: f"{name}: {m}")


def _trl_dpo(case, hf, **config):
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    from datasets import Dataset

    rows = [{"prompt": "x", "chosen": "y", "rejected": "z"}]
    args = DPOConfig(output_dir=str(case.tmp / "trl"), report_to="none", use_cpu=True, bf16=False, **config)
    trainer = DPOTrainer(model=hf, ref_model=_hf(case.folder), args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(case.folder))
    loss = trainer._compute_loss(hf, case.trl_batch, False)
    loss.backward()
    return trainer, loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss,trl_config", [
    ("sigmoid", dict(loss_type=["sigmoid"], beta=0.1)),
    ("hinge", dict(loss_type=["hinge"], beta=0.05)),
    ("ipo", dict(loss_type=["ipo"], beta=0.5)),
    ("robust", dict(loss_type=["robust"], beta=0.1, label_smoothing=0.2)),
    ("rpo", dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.7], beta=0.1)),
])
def test_dpo_losses_equal_trl(case, loss, trl_config):
    hf = _hf_policy(case)
    _, trl_loss, trl_metrics = _trl_dpo(case, hf, **trl_config)
    kw = dict(beta=trl_config["beta"], label_smoothing=trl_config.get("label_smoothing", 0.0))
    fn = dpo_loss(case.model, loss="sigmoid", sft_weight=0.7, **kw) if loss == "rpo" else dpo_loss(case.model, loss=loss, **kw)
    value, metrics, grads = _ember(case, case.policy, fn, _ember_batch(case.trl_batch), frozen=case.ref)
    assert abs(float(value) - float(trl_loss)) < TOL
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected"):
        assert abs(float(metrics[name]) - trl_metrics[name]) < TOL * max(1.0, abs(trl_metrics[name])), name
    assert float(metrics["identical_pairs"]) == pytest.approx(1 / 3)
    _assert_grads_equal(case, grads, hf)


def test_reference_logps_equal_transformers(case):
    hf = _hf_policy(case)
    trainer, _, _ = _trl_dpo(case, hf, loss_type=["sigmoid"])
    trl_chosen, trl_rejected = trainer.compute_ref_log_probs(trainer.ref_model, case.trl_batch)
    batch = _ember_batch(case.trl_batch)
    inputs = torch.cat([batch["chosen_inputs"], batch["rejected_inputs"]])
    targets = torch.cat([batch["chosen_targets"], batch["rejected_targets"]])
    with torch.no_grad():
        ours = sequence_logps(response_logps(case.model, case.ref, inputs, targets)[0], targets).total
    torch.testing.assert_close(ours, torch.cat([trl_chosen, trl_rejected]), atol=TOL, rtol=0)


def _cpo_self(loss_type, beta, **kw):
    acc = types.SimpleNamespace(device=torch.device("cpu"))
    return types.SimpleNamespace(loss_type=loss_type, beta=beta, alpha=0.0, label_smoothing=kw.get("label_smoothing", 0.0),
                                 simpo_gamma=kw.get("simpo_gamma", 0.5), accelerator=acc)


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_equal_trl(case, loss):
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    hf = _hf_policy(case)
    ids, mask = case.trl_batch["input_ids"], case.trl_batch["completion_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    logits = hf(input_ids=ids, attention_mask=case.trl_batch["attention_mask"]).logits
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    b = len(PAIRS)
    nll = torch.nn.functional.cross_entropy(logits[:b, :-1].flatten(0, 1), labels[:b, 1:].flatten(), ignore_index=-100)
    if loss == "simpo":
        beta, gamma, smooth = 2.0, 0.5, 0.1
        losses, c_rew, r_rew = CPOTrainer.cpo_loss(_cpo_self("simpo", beta, simpo_gamma=gamma, label_smoothing=smooth),
                                                   logps[:b], logps[b:])
        trl_loss = losses.mean()
        fn = dpo_loss(case.model, loss="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=smooth)
    else:
        beta = 0.1
        ns = types.SimpleNamespace(beta=beta, accelerator=types.SimpleNamespace(device=torch.device("cpu")))
        losses, c_rew, r_rew, _, _ = ORPOTrainer.odds_ratio_loss(ns, logps[:b], logps[b:])
        trl_loss = nll - losses.mean()
        fn = dpo_loss(case.model, loss="orpo", beta=beta)
    trl_loss.backward()
    value, metrics, grads = _ember(case, case.policy, fn, _ember_batch(case.trl_batch))
    assert abs(float(value) - float(trl_loss)) < TOL
    assert abs(float(metrics["rewards/chosen"]) - float(c_rew.mean())) < TOL
    assert abs(float(metrics["rewards/rejected"]) - float(r_rew.mean())) < TOL
    assert abs(float(metrics["rewards/margins"]) - float((c_rew - r_rew).mean())) < TOL
    _assert_grads_equal(case, grads, hf)


def test_lora_policy_against_its_base_equals_trl_with_peft(case):
    """A LoRA policy whose reference is its own base with the adapters off (TRL: `ref_model=None` on a PEFT model)."""
    peft = pytest.importorskip("peft")
    rank, alpha = 4, 8.0
    model = to_lora(case.model, rank=rank, alpha=alpha, targets=("wq", "wv"))
    gen = torch.Generator().manual_seed(2)
    lora = pytree.tree_map(lambda t: 0.1 * torch.randn(t.shape, generator=gen), model.init(random.key(0))["lora"])
    params = {"base": case.ref, "lora": lora}

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    # A new adapter (TRL makes it from `peft_config`): TRL's reference is the base, the adapters disabled.
    args = DPOConfig(output_dir=str(case.tmp / "trl-lora"), report_to="none", use_cpu=True, bf16=False, beta=0.1)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = DPOTrainer(model=_hf(case.folder), ref_model=None, args=args, peft_config=config,
                         train_dataset=Dataset.from_list([{"prompt": "x", "chosen": "y", "rejected": "z"}]),
                         processing_class=AutoTokenizer.from_pretrained(case.folder))
    assert trainer.ref_model is None and list(trainer.model.peft_config) == ["default"]
    factors = {("q_proj", "A"): lora["blocks"]["attn"]["wq"]["weight"]["a"],
               ("q_proj", "B"): lora["blocks"]["attn"]["wq"]["weight"]["b"],
               ("v_proj", "A"): lora["blocks"]["attn"]["wv"]["weight"]["a"],
               ("v_proj", "B"): lora["blocks"]["attn"]["wv"]["weight"]["b"]}
    named = {}
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_" in name:
                layer = int(name.split(".layers.")[1].split(".")[0])
                key = (name.split(".self_attn.")[1].split(".")[0], name.split(".lora_")[1][0])
                p.copy_(factors[key][layer])
                named[(key, layer)] = p
    assert len(named) == 4 * case.model.config.n_layers
    trainer.model.train()
    trl_loss = trainer._compute_loss(trainer.model, case.trl_batch, False)
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    value, metrics, grads = _ember(case, params, dpo_loss(model, beta=0.1), _ember_batch(case.trl_batch))
    assert abs(float(value) - float(trl_loss)) < TOL
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert abs(float(metrics[name]) - trl_metrics[name]) < TOL * max(1.0, abs(trl_metrics[name])), name
    assert all(float(g.abs().max()) == 0.0 for g in pytree.tree_leaves(grads["base"]))  # the base is frozen
    short = {"q_proj": "wq", "v_proj": "wv"}
    for ((proj, ab), layer), p in named.items():
        ours = grads["lora"]["blocks"]["attn"][short[proj]]["weight"][ab.lower()][layer]
        torch.testing.assert_close(ours, p.grad, atol=TOL, rtol=TOL, msg=lambda m: f"{proj} {ab} {layer}: {m}")


@pytest.mark.parametrize("rows", [CHAT_ROWS, TEXT_ROWS], ids=["chat", "text"])
def test_tokenized_pairs_equal_trl(case, rows):
    """The prompt / response boundary is TRL's, for chat messages (ChatML: `<|im_end|>\\n` closes the reply) and text."""
    from ember.data import load_model_tokenizer
    from ember.data.preference import tokenize_preference_example

    trainer = _trl_trainer(case.folder, case.tmp / "trl-tok", rows)
    tok = load_model_tokenizer(case.folder)
    for i, row in enumerate(rows):
        ours = tokenize_preference_example(row, tok)
        theirs = trainer.train_dataset[i]
        assert [x.tolist() for x in ours] == [theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"]]
