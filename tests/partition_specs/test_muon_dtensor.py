"""Muon on DTensor meshes (gloo processes on CPU) equals one device, each matrix orthogonalised whole.

`_muon_dtensor_worker.py` runs 3 train steps of Muon + AdamW groups on `fsdp=2`, `tp=2`, `ep=2` (a tiny
Qwen3-MoE) and `fsdp=2,tp=2`, with both Newton-Schulz placements, and once compiled with Inductor. Each run's
parameters equal one device's within 1e-5 (measured: below 4e-7), every momentum has its parameter's shard
shape, and one optimizer update issues the collectives its placement says: per matrix split along its own
axes, one all-gather per splitting mesh dimension (`gather`), or two moves between the matrix's axes and the
layers axis (`owner`; gloo has no all-to-all, so DTensor runs each as an all-gather), and expert stacks split
by `ep` move nowhere. The clip's global norm is the one all-reduce besides.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _muon_dtensor_worker as M  # noqa: E402
from _processes import run_in_own_group  # noqa: E402

pytestmark = pytest.mark.xdist_group("muon_dtensor")  # one worker runs the module: its fixture runs once

ATOL = 1e-5
MUON_MATRICES = 7  # per block: wq, wk, wv, wo, gate, up, down (stacked over the layers)
MOE_MUON_MATRICES = 8  # wq, wk, wv, wo, the router, and the experts' gate, up, down (orthogonalised per expert)
RUNS = {  # world -> meshes (each with both placements)
    2: ["fsdp=2", "tp=2", "ep=2"],
    4: ["fsdp=2,tp=2"],
}
ALL_RUNS = [f"{m} {p}" for ms in RUNS.values() for m in ms for p in M.PLACEMENTS]
# all-gathers of one update: (mesh, placement) -> count. fsdp and tp each split every matrix once; under
# fsdp=2,tp=2 `owner` moves the fsdp split to the 2 layers and gathers the tp split (2 layers do not divide by 4).
ALL_GATHERS = {
    ("fsdp=2", "gather"): MUON_MATRICES, ("fsdp=2", "owner"): 2 * MUON_MATRICES,
    ("tp=2", "gather"): MUON_MATRICES, ("tp=2", "owner"): 2 * MUON_MATRICES,
    ("ep=2", "gather"): 0, ("ep=2", "owner"): 0,
    ("fsdp=2,tp=2", "gather"): 2 * MUON_MATRICES, ("fsdp=2,tp=2", "owner"): 3 * MUON_MATRICES,
}


def _launch(out, world, meshes, *extra):
    cmd = [sys.executable, M.__file__, "--world", str(world), "--meshes", ";".join(meshes), "--out", str(out), *extra]
    proc = run_in_own_group(cmd, timeout=900)  # compiled on a cold Inductor cache: a few minutes on 2 cores
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for world, meshes in RUNS.items():
        results.update(_launch(tmp_path_factory.mktemp(f"muon_world{world}"), world, meshes))
    return results


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("muon_compiled"), 2, ["fsdp=2"], "--placements", "gather", "--compile")


def _ok(res, run):
    assert "error" not in res[run], f"{run} failed in the worker:\n{res[run]['error']}"
    return res[run]


@pytest.mark.parametrize("run", ALL_RUNS)
def test_three_steps_equal_one_device(runs, run):
    res = _ok(runs, run)
    assert res["max_param_diff"] < ATOL
    assert res["mu_local_matches_param"]  # the group's momentum sharded like its parameter
    assert len(res["muon_leaves"]) == (MOE_MUON_MATRICES if run.startswith("ep=") else MUON_MATRICES)


@pytest.mark.parametrize("run", ALL_RUNS)
def test_one_update_issues_the_placements_collectives(runs, run):
    res = _ok(runs, run)
    kinds = {}
    for key, n in res["update_collectives"].items():
        kinds[key.split(" x ")[0]] = kinds.get(key.split(" x ")[0], 0) + n
    mesh, placement = run.split(" ")
    assert kinds.get("all_gather", 0) == ALL_GATHERS[mesh, placement], res["update_collectives"]
    assert set(kinds) <= {"all_gather", "all_reduce"}
    assert kinds["all_reduce"] == (2 if mesh == "fsdp=2,tp=2" else 1)  # the clip's norm, once per mesh dim


def test_compiled_step_compiles_once_and_equals_one_device(compiled):
    res = _ok(compiled, "fsdp=2 gather")
    assert res["max_param_diff"] < ATOL
    assert res["compile_count"] == 1
