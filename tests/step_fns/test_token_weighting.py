"""Token-weighted accumulation: `microbatches=k` gives the step of `k=1` for any mask.

With targets randomly ignored (rows 0-1 wholly, so one microbatch of four has no valid token),
the loss, token count and gradients of `k = 2, 4` equal `k = 1` within 1e-5 (fp32) on eager,
Inductor and XLA, and the loss is the full batch's token mean. The dp=2 mesh cases (ranks holding
different counts) are in `test_mesh_parity.py`.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from ember import optim
from ember.core import TrainState
from ember.core.step_fns import TokenLoss, cross_entropy, eval_step, train_step
from ember.launch.loop import evaluate

from _token_weighting import MICROBATCHES, SEEDS, loss_fn, make_case, run_step

SCRIPT = pathlib.Path(__file__).with_name("_token_weighting.py")
TOL = dict(rtol=1e-5, atol=1e-5)


def full_batch_token_mean(params, batch):
    logits = torch.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    return cross_entropy(logits, batch["y"], z_loss=1e-3)


def check_same_as_one_microbatch(results, params, batch):
    """`results`: {microbatches: (loss, tokens, grads)} of one backend."""
    loss1, tokens1, grads1 = results[1]
    assert tokens1 == int((batch["y"] != -100).sum())
    torch.testing.assert_close(torch.tensor(loss1), full_batch_token_mean(params, batch), **TOL)
    for m, (loss, tokens, grads) in results.items():
        assert tokens == tokens1, (m, tokens, tokens1)
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(loss1), **TOL, msg=f"loss, microbatches={m}")
        for name in grads:
            torch.testing.assert_close(grads[name], grads1[name], **TOL, msg=f"grad {name}, microbatches={m}")


@pytest.mark.parametrize("seed", SEEDS)
def test_microbatches_match_one_batch_eager_and_inductor(seed):
    params, batch = make_case(seed)
    runs = {m: run_step(("eager", "inductor"), m, params, batch) for m in MICROBATCHES}
    for backend in ("eager", "inductor"):
        check_same_as_one_microbatch({m: runs[m][backend] for m in MICROBATCHES}, params, batch)


@pytest.mark.slow
@pytest.mark.xla
def test_microbatches_match_one_batch_on_xla():
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "eager,xla"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for seed in SEEDS:
        params, batch = make_case(seed)
        results = {}
        for m in MICROBATCHES:
            r = out[f"{seed}/{m}"]["xla"]
            results[m] = (r["loss"], r["tokens"], {k: torch.tensor(v) for k, v in r["grads"].items()})
        check_same_as_one_microbatch(results, params, batch)


def test_mean_of_means_is_what_a_mean_loss_gets():
    """A plain mean loss keeps its documented meaning: the mean of the microbatches' means."""
    params, batch = make_case(0)

    def mean_loss(p, b, *, key):
        return loss_fn(p, b, key=key).mean()

    loss1, _, _ = run_step(("eager",), 1, params, batch)["eager"]
    state = TrainState.create(params=params, tx=optim.sgd(1.0))
    _, metrics = train_step(mean_loss, microbatches=2)(state, batch)
    halves = [full_batch_token_mean(params, {k: v[i * 4:(i + 1) * 4] for k, v in batch.items()}) for i in (0, 1)]
    torch.testing.assert_close(metrics["loss"], (halves[0] + halves[1]) / 2, **TOL)
    assert "tokens" not in metrics
    assert abs(float(metrics["loss"]) - loss1) > 1e-3  # why losses should carry their count


def test_eval_step_reports_token_mean_and_count():
    params, batch = make_case(1)
    metrics = eval_step(loss_fn)(params, batch)
    torch.testing.assert_close(metrics["loss"], full_batch_token_mean(params, batch), **TOL)
    assert float(metrics["tokens"]) == float((batch["y"] != -100).sum())


def test_evaluate_weights_batches_by_tokens():
    params, batch = make_case(2)
    halves = [{k: v[i * 4:(i + 1) * 4] for k, v in batch.items()} for i in (0, 1)]
    metrics = evaluate(eval_step(loss_fn), params, halves)
    torch.testing.assert_close(metrics["loss"], full_batch_token_mean(params, batch), **TOL)
    assert float(metrics["tokens"]) == float((batch["y"] != -100).sum())


def test_no_valid_token_gives_zero_loss_and_zero_grads():
    params, batch = make_case(0)
    batch = dict(batch, y=torch.full_like(batch["y"], -100))
    loss, tokens, grads = run_step(("eager",), 2, params, batch)["eager"]
    assert (loss, tokens) == (0.0, 0.0)
    assert all(bool((g == 0).all()) for g in grads.values())


BAD_TOKEN_LOSSES = [
    ("count_is_mask", lambda t, v: TokenLoss(t.sum(), v), r"count is a tensor of shape \(8, 6\).*valid\.sum\(\)"),
    ("count_is_int", lambda t, v: TokenLoss(t.sum(), 5), r"count is an object of type int"),
    ("count_is_bool", lambda t, v: TokenLoss(t.sum(), v.any()), r"count is a tensor of shape \(\) and dtype torch\.bool"),
    ("total_not_summed", lambda t, v: TokenLoss(t, v.sum()), r"total is a tensor of shape \(8, 6\).*per_token\.sum\(\)"),
    ("total_integer", lambda t, v: TokenLoss(v.sum(), v.sum()), r"total is a tensor of shape \(\) and dtype torch\.int64"),
]


@pytest.mark.parametrize("name,make,match", BAD_TOKEN_LOSSES, ids=[c[0] for c in BAD_TOKEN_LOSSES])
def test_malformed_token_loss_names_the_fix(name, make, match):
    params, batch = make_case(0)

    def bad_loss(p, b, *, key):
        logits = torch.tanh(b["x"] @ p["w1"]) @ p["w2"]
        per_token = cross_entropy(logits, b["y"], reduction="none")
        return make(per_token, b["y"] != -100)

    state = TrainState.create(params=params, tx=optim.sgd(1.0))
    with pytest.raises(ValueError, match=match):
        train_step(bad_loss)(state, batch)
    with pytest.raises(ValueError, match=match):
        eval_step(bad_loss)(params, batch)
