"""Muon under torch_xla SPMD (virtual CPU devices) equals one device: each matrix orthogonalised whole.

`_xla_muon_worker.py` (one subprocess per device count, in turn) trains the models and optimizer of
`test_muon_dtensor.py` 3 steps under `jit(backend="xla")` on fsdp=2, tp=2, ep=2 (a tiny Qwen3-MoE) and
fsdp=2,tp=2, each against the same steps on one device, and reads the collectives XLA's partitioner put in one
optimizer update. There the partitioner places the Newton-Schulz work itself (`on_whole_axes`'s placements are
DTensor's); its collectives per update are in BENCHMARKS.md ("Muon on meshes").
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
ALL_MESHES = [m for ms in MESHES.values() for m in ms]
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
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_three_compiled_steps_equal_one_device(runs, mesh):
    res = runs[mesh]
    assert res["max_param_diff"] < ATOL
    assert res["per_step_compiles"] == [1, 0, 0]


@pytest.mark.xla
@pytest.mark.slow
def test_xla_places_the_iteration_itself(runs):
    """The partitioner's own placement, as measured (BENCHMARKS.md): an `ep=2` update gathers each expert stack
    once (3 all-gathers, no all-reduce of a matrix); an `fsdp=2` update communicates inside the iteration (more
    all-gathers than its 7 matrices). A change here is a change in what XLA does with ember's update."""
    ep = runs["ep=2"]["update_collectives"]
    assert len(ep.get("all-gather", [])) == 3 and all(len(c["dims"][0]) == 4 for c in ep["all-gather"])
    assert all(c["dims"] == [[]] for c in ep.get("all-reduce", []))  # the clip's norm and scalars
    assert len(runs["fsdp=2"]["update_collectives"]["all-gather"]) > 7
