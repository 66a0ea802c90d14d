"""DeepSeek-V3's latent attention and mixture on DTensor (gloo) meshes, against one device.

`_moe_dtensor_worker.py --family deepseek_v3` (latent attention with the queries' bottleneck, a dense
first layer, group-limited sigmoid routing with its expert bias moved by the step) on `fsdp=2,tp=2`
(heads split over tp: the up-projections of the latents and the output projection) and `ep=2,tp=2`
(experts split too). Gradients of the first batch, three AdamW steps' losses and the final parameters
must equal the single-device run's within 1e-5.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _moe_dtensor_worker as W  # noqa: E402
from _processes import run_in_own_group  # noqa: E402

pytestmark = pytest.mark.xdist_group("latent_attention_dtensor")  # one worker runs the module: its fixture runs once

MESHES = ["fsdp=2,tp=2", "ep=2,tp=2"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step

    model, tx, state, batches, loss_fn = W.setup(None, "deepseek_v3")
    grads = dict(tree_leaves_with_path(W.grads_of(loss_fn, state.params, batches[0])))
    losses, _, state = W.run(train_step(loss_fn, tx), state, batches)
    return {"grads": grads, "losses": [float(x) for x in losses], "params": dict(tree_leaves_with_path(state.params))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("latent_attention")
    cmd = [sys.executable, W.__file__, "--world", "4", "--meshes", ";".join(MESHES), "--out", str(out),
           "--capacities", "dropless", "--family", "deepseek_v3"]
    proc = run_in_own_group(cmd, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out, "results.json")) as f:
        results = {key.split("/")[0]: res for key, res in json.load(f).items()}
    for mesh, res in results.items():
        res["saved"] = os.path.join(out, f"{mesh}_None.pt".replace("=", "").replace(",", "_"))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_latent_attention_on_a_mesh_matches_one_device(runs, reference, mesh):
    res = runs[mesh]
    assert "error" not in res, f"{mesh} failed in the worker:\n{res['error']}"
    # blocks.0: the stack of the dense first layer, (layers, heads x (nope + v), kv rank); heads split over tp
    assert res["local"]["blocks.0.attn.wkv_b.weight"][1:2] == [4 * (8 + 6) // 2]
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
    saved = torch.load(res["saved"])
    for what in ("grads", "params"):
        assert sorted(saved[what]) == sorted(reference[what])
        for path, want in reference[what].items():
            torch.testing.assert_close(saved[what][path], want, rtol=0, atol=ATOL, msg=lambda m: f"{what} {path}: {m}")
