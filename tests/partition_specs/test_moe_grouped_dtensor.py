"""The grouped dropless experts on DTensor (gloo) meshes without `ep`, against one device.

`fsdp=2`, `tp=2` and `fsdp=2,tp=2` run `_moe_dtensor_worker.py`'s dropless model (a sigmoid router whose
expert bias the step moves by the summed loads): each process sorts and computes the tokens it holds
(`grouped_experts_on_shards`). Gradients of the first batch, three AdamW steps' losses and the final
parameters must equal the single-device run's within 1e-5, every MoE layer must have run its three
grouped matmuls, and no token may move by all-to-all.
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

from ember.core.compat.grouped_mm import grouped_mm_runs  # noqa: E402

pytestmark = [pytest.mark.xdist_group("moe_grouped_dtensor"),  # one worker runs the module: its fixture runs once
              pytest.mark.skipif(not grouped_mm_runs(torch.float32, "cpu", W.MOE["d_model"], W.MOE["moe_ffn_dim"]),
                                 reason="float32 runs padded on this torch (WORKAROUNDS['grouped_mm_float32'])")]

MESHES = {2: ["fsdp=2", "tp=2"], 4: ["fsdp=2,tp=2"]}
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step

    model, tx, state, batches, loss_fn = W.setup(None)
    grads = dict(tree_leaves_with_path(W.grads_of(loss_fn, state.params, batches[0])))
    losses, _, state = W.run(train_step(loss_fn, tx), state, batches)
    return {"grads": grads, "losses": [float(x) for x in losses], "params": dict(tree_leaves_with_path(state.params))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for world, meshes in MESHES.items():
        out = tmp_path_factory.mktemp(f"moe_grouped_world{world}")
        cmd = [sys.executable, W.__file__, "--world", str(world), "--meshes", ";".join(meshes), "--out", str(out),
               "--capacities", "dropless"]
        proc = run_in_own_group(cmd, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(os.path.join(out, "results.json")) as f:
            for key, res in json.load(f).items():
                mesh = key.split("/")[0]
                saved = os.path.join(out, f"{mesh}_None.pt".replace("=", "").replace(",", "_"))
                results[mesh] = dict(res, saved=saved)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [m for ms in MESHES.values() for m in ms])
def test_grouped_experts_on_a_mesh_match_one_device(runs, reference, mesh):
    res = runs[mesh]
    assert "error" not in res, f"{mesh} failed in the worker:\n{res['error']}"
    assert res["grouped_per_step"] == 3 * W.MOE["n_layers"], res["grouped_per_step"]  # gate, up, down per layer
    assert res["alltoall_per_step"] == []
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=ATOL)
    saved = torch.load(res["saved"])
    for what in ("grads", "params"):
        assert sorted(saved[what]) == sorted(reference[what])
        for path, want in reference[what].items():
            torch.testing.assert_close(saved[what][path], want, rtol=0, atol=ATOL, msg=lambda m: f"{what} {path}: {m}")
