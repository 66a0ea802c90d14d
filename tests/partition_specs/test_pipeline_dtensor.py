"""A stacked Llama over the mesh `pp=2` (DTensor, gloo): `layers -> pp` splits the blocks by stage, and the
step's gradients, SGD losses and final parameters equal one device's (eagerly, compiled by ember's `jit`,
and with as few microbatches as stages), on every process; packed `segment_ids` travel with their microbatch,
and the tied embedding (read by the first stage, the head on every process) gets its whole gradient."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _pipeline_dtensor_worker as W  # noqa: E402

pytestmark = pytest.mark.xdist_group("pipeline_dtensor")  # one worker runs the module: its fixture runs once
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step

    model, tx, state, batches, loss_fn = W.setup()
    grads = dict(tree_leaves_with_path(W.grads_of(loss_fn, state.params, batches[0])))
    step, losses = train_step(loss_fn, tx), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return {"grads": grads, "losses": losses, "params": dict(tree_leaves_with_path(state.params))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_dtensor")
    proc = subprocess.run([sys.executable, W.__file__, "--out", str(out)], capture_output=True, text=True,
                          timeout=900, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = []
    for rank in range(2):
        with open(os.path.join(out, f"results_{rank}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case", list(W.CASES))
def test_pp2_step_equals_one_device_on_every_process(runs, reference, case, rank):
    res = runs[rank][case]
    assert "error" not in res, f"{case} failed in the worker:\n{res['error']}"
    assert res["local"]["blocks.attn.wq.weight"][0] == W.LLAMA["n_layers"] // 2  # each process: its stage's layers
    assert res["local"]["wte.weight"] == list(reference["params"]["wte.weight"].shape)  # the rest whole
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
    for path, want in reference["grads"].items():
        torch.testing.assert_close(torch.tensor(res["grads"][path]), want, rtol=0, atol=ATOL, msg=path)
    for path, want in reference["params"].items():
        torch.testing.assert_close(torch.tensor(res["params"][path]), want, rtol=0, atol=ATOL, msg=path)
