"""Expert parallelism on DTensor (gloo) against one device: a tiny Qwen3-MoE on `ep=2`, `ep=2,fsdp=2`, `ep=2,tp=2`.

`_moe_dtensor_worker.py` runs every mesh with a dropless capacity (a sigmoid router whose expert bias
the step moves by the summed loads) and with one that drops about half the (token, expert) pairs. Gradients of the first batch, three AdamW steps' losses and the
final parameters must equal the single-device run's (float32 sums in another order: 1e-5), the
dropped fraction must be the same, each device must hold only its experts, and the token exchange
must be DTensor's Shard -> Shard all-to-all over `ep` (twice per MoE layer forward, twice backward).
Dropless, each process computes only the filled slots of its experts with grouped matmuls, where the
kernel runs (`grouped_slots_on_shards`).
The compiled launcher under torchrun is `tests/launch/test_torchrun.py`'s.
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

pytestmark = pytest.mark.xdist_group("moe_dtensor")  # one worker runs the module: its shared fixture runs once

MESHES = {2: ["ep=2"], 4: ["ep=2,fsdp=2", "ep=2,tp=2"]}
RUNS = [f"{m}/{c}" for ms in MESHES.values() for m in ms for c in W.CAPACITIES]
E, I, D = W.MOE["n_experts"], W.MOE["moe_ffn_dim"], W.MOE["d_model"]
EXPERTS_LOCAL = {"ep=2": [E // 2, I, D], "ep=2,fsdp=2": [E // 2, I, D // 2], "ep=2,tp=2": [E // 2, I // 2, D]}
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    """Per capacity: gradients of the first batch, losses, dropped fractions and final params on one device."""
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step

    out = {}
    for name, capacity in W.CAPACITIES.items():
        model, tx, state, batches, loss_fn = W.setup(capacity)
        grads = dict(tree_leaves_with_path(W.grads_of(loss_fn, state.params, batches[0])))
        losses, dropped, state = W.run(train_step(loss_fn, tx), state, batches)
        out[name] = {"grads": grads, "losses": [float(x) for x in losses], "dropped": [float(x) for x in dropped],
                     "params": dict(tree_leaves_with_path(state.params))}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Results per mesh and capacity, from one worker launch per world size (about 25 s + 50 s on 2 cores)."""
    results = {}
    for world, meshes in MESHES.items():
        out = tmp_path_factory.mktemp(f"moe_world{world}")
        cmd = [sys.executable, W.__file__, "--world", str(world), "--meshes", ";".join(meshes), "--out", str(out)]
        proc = run_in_own_group(cmd, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(os.path.join(out, "results.json")) as f:
            for key, res in json.load(f).items():
                mesh, capacity = key.split("/")
                saved = os.path.join(out, f"{mesh}_{W.CAPACITIES[capacity]}.pt".replace("=", "").replace(",", "_"))
                results[key] = dict(res, saved=saved)
    return results


def _ok(runs, key):
    res = runs[key]
    assert "error" not in res, f"{key} failed in the worker:\n{res['error']}"
    return res


@pytest.mark.slow
@pytest.mark.parametrize("key", RUNS)
def test_losses_and_dropped_pairs_match_one_device(runs, reference, key):
    res, ref = _ok(runs, key), reference[key.split("/")[1]]
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=ATOL)
    assert res["dropped"] == ref["dropped"], (res["dropped"], ref["dropped"])
    assert (max(ref["dropped"]) > 0.2) == key.endswith("drops")


@pytest.mark.slow
@pytest.mark.parametrize("key", RUNS)
def test_gradients_and_updated_params_match_one_device(runs, reference, key):
    res, ref = _ok(runs, key), reference[key.split("/")[1]]
    saved = torch.load(res["saved"])
    for what in ("grads", "params"):
        assert sorted(saved[what]) == sorted(ref[what])
        for path, want in ref[what].items():
            torch.testing.assert_close(saved[what][path], want, rtol=0, atol=ATOL, msg=lambda m: f"{what} {path}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("key", RUNS)
def test_each_device_holds_only_its_experts(runs, key):
    local, mesh = _ok(runs, key)["local"], key.split("/")[0]
    for proj in ("gate", "up"):  # the blocks stacked: the layers axis first, whole
        assert local[f"blocks.mlp.{proj}"] == [W.MOE["n_layers"], *EXPERTS_LOCAL[mesh]]
    assert local["blocks.mlp.down"][1] == E // 2


@pytest.mark.slow
@pytest.mark.parametrize("key", RUNS)
def test_tokens_move_by_all_to_all_over_ep(runs, key):
    """Per step and MoE layer: to the experts and back in the forward, and both again in the backward; where
    the grouped kernel runs (dropless), each layer's slot counts (G, E) travel with the buffer once."""
    res = _ok(runs, key)
    calls, layers = res["alltoall_per_step"], W.MOE["n_layers"]
    buffer, counts = [c for c in calls if len(c[3]) == 4], [c for c in calls if len(c[3]) == 2]
    assert len(buffer) == 4 * layers and len(buffer) + len(counts) == len(calls), calls
    assert {c[0] for c in calls} == {"ep"}
    assert sorted({(c[1], c[2]) for c in buffer}) == [(0, 1), (1, 0)]  # Shard(0) <-> Shard(1) of (B, E, C, d)
    grouped = key.endswith("dropless") and grouped_mm_runs(torch.float32, "cpu", D, I)
    assert res["grouped_per_step"] == (3 * layers if grouped else 0)  # gate, up, down on the filled slots
    assert [(c[1], c[2]) for c in counts] == [(0, 1)] * (layers if grouped else 0)
