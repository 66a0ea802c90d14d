"""Muon under torch_xla SPMD (virtual CPU devices) equals one device: each matrix orthogonalised whole.

`_xla_muon_worker.py` (one subprocess per device count, in turn) trains the models and optimizer of
`test_muon_dtensor.py` 3 steps under `jit(backend="xla")` on fsdp=2, tp=2, ep=2 (a tiny Qwen3-MoE) and
fsdp=2,tp=2 with both placements, each against the same steps on one device, and reads the collectives XLA's
partitioner put in one optimizer update: the placements are sharding constraints from the model's logical axes
(`muon(param_axes=model.axes)`), and the collectives are the ones the DTensor test counts, all-to-alls for
owner's moves.
"""

import importlib.util
import json
import os
import pathlib
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _processes
from _processes import run_in_own_group  # noqa: E402

pytestmark = pytest.mark.xdist_group("muon_xla")  # one worker runs the module: its shared fixture runs once

HERE = pathlib.Path(__file__).parent
MESHES = {2: ["fsdp=2", "tp=2", "ep=2"], 4: ["fsdp=2,tp=2"]}
ALL_RUNS = [f"{m} {p}" for ms in MESHES.values() for m in ms for p in ("owner", "gather")]
# (mesh, placement) -> the non-scalar collectives of one update, 7 stacked matrices: owner moves each matrix's split
# to the layers axis and back (two all-to-alls), gather gathers it once per splitting mesh axis; under fsdp=2,tp=2
# the 2 layers take fsdp and tp is gathered.
COLLECTIVES = {
    ("fsdp=2", "owner"): {"all-to-all": 14}, ("fsdp=2", "gather"): {"all-gather": 7},
    ("tp=2", "owner"): {"all-to-all": 14}, ("tp=2", "gather"): {"all-gather": 7},
    ("ep=2", "owner"): {}, ("ep=2", "gather"): {},
    ("fsdp=2,tp=2", "owner"): {"all-to-all": 14, "all-gather": 7}, ("fsdp=2,tp=2", "gather"): {"all-gather": 14},
}
ATOL = 1e-5  # measured: below 4.4e-7 after 3 steps
WORKER_TIMEOUT = 900  # seconds; about 70 s of CPU each, several times that on a loaded machine


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla], or make install-xla)")
    out = {}
    for n, meshes in MESHES.items():
        dump = tmp_path_factory.mktemp(f"muon_hlo{n}")
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(n),
                   XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=SyncTensorsGraph.*")
        proc = run_in_own_group([sys.executable, str(HERE / "_xla_muon_worker.py"), str(dump), *meshes], env=env,
                                timeout=WORKER_TIMEOUT)
        assert proc.returncode == 0, f"worker {n} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.parametrize("run", ALL_RUNS)
def test_three_compiled_steps_equal_one_device(runs, run):
    res = runs[run]
    assert res["max_param_diff"] < ATOL
    assert sum(res["per_step_compiles"]) <= 1 and res["per_step_compiles"][1:] == [0, 0]  # ep=2's 2nd: cached


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.parametrize("run", ALL_RUNS)
def test_one_update_issues_the_placements_collectives(runs, run):
    """The matrices' collectives of one update are the placement's (the all-reduces are scalars: the clip's norm,
    hyperparameters): none under ep=2, where the expert stacks stay split."""
    found = runs[run]["update_collectives"]
    mesh, placement = run.split(" ")
    kinds = {op: len(found[op]) for op in found if op != "all-reduce"}
    assert kinds == COLLECTIVES[mesh, placement], found
    assert all(c["dims"] == [[]] for c in found.get("all-reduce", []))
