"""Expert parallelism under torch_xla SPMD: `ember.models.layers.MoE` on the `ep` rules of `for_mesh`.

A tiny Qwen3-MoE (2 MoE layers, 8 experts, top-2) trained 4 steps on fresh batches (so the routing
changes) under `jit(backend="xla")` on virtual CPU devices, for meshes ep=2 (2 devices), ep=2,fsdp=2
and ep=2,tp=2 (4) and ep=4,fsdp=2 (8, the launcher's example), each against the single-device
eager run of the same steps: dropless (`capacity_factor=None`) and dropping (0.5). The worker
(`_xla_moe_worker.py`, one subprocess per device count, started together) also reads the
collectives of the compiled step from XLA's HLO dump: the token exchange must be an all-to-all
within each `ep` group, never an all-gather of the dispatch buffer (maxtext#4179's fallback). A fourth
worker trains a tiny DeepSeek-V3 (latent attention, group-limited sigmoid routing) on fsdp=2,tp=2 and
ep=2,tp=2 against its own eager run.
"""

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group("moe_xla")  # one worker runs the module: its shared fixture runs once

HERE = pathlib.Path(__file__).parent
MESHES = {2: ["ep=2"], 4: ["ep=2,fsdp=2", "ep=2,tp=2"], 8: ["ep=4,fsdp=2"]}
ALL_MESHES = [m for ms in MESHES.values() for m in ms]
CONFIGS = ["dropless", "dropping"]
STEPS, MOE_LAYERS, D_MODEL = 4, 2, 32
CAPACITY = {"dropless": 12, "dropping": 2}  # C: T=12 tokens; ceil(0.5 * 12 * 2 / 8) = 2
# float32, SGD: XLA fuses and GSPMD splits the same sums in another order (measured: losses <= 4.8e-7,
# gradients <= 4e-8, parameters after 4 steps <= 1.2e-7).
TOL = 1e-5
WORKER_TIMEOUT = 900  # seconds; each worker takes 25-50 s of CPU, several times that in wall time on a loaded machine


def _run_worker(n, meshes, dump, *options):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(n),
               XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=SyncTensorsGraph.*")
    return subprocess.Popen([sys.executable, str(HERE / "_xla_moe_worker.py"), *options, str(dump), *meshes], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


LATENT_MESHES = ["fsdp=2,tp=2", "ep=2,tp=2"]
"""DeepSeek-V3's latent attention (heads split over tp) with its mixture, on 4 devices, dropless."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla], or make install)")
    procs = {n: _run_worker(n, meshes, tmp_path_factory.mktemp(f"hlo{n}")) for n, meshes in MESHES.items()}
    procs["deepseek_v3"] = _run_worker(4, LATENT_MESHES, tmp_path_factory.mktemp("hlo_latent"), "--family",
                                       "deepseek_v3", "--configs", "dropless")
    out = {}
    try:
        for n, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=WORKER_TIMEOUT)
            assert proc.returncode == 0, f"worker {n} failed (rc {proc.returncode}):\n{stderr[-4000:]}"
            result = json.loads(stdout.strip().splitlines()[-1])
            if n == "deepseek_v3":
                out["deepseek_v3"] = result["dropless"]
                continue
            for config in CONFIGS:
                out.setdefault(config, {"eager": result[config]["eager"], "meshes": {}})
                out[config]["meshes"].update(result[config]["meshes"])
    finally:
        for proc in procs.values():  # a failed or timed-out worker takes its children with it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return out


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_dropless_step_matches_single_device(runs, mesh):
    eager, run = runs["dropless"]["eager"], runs["dropless"]["meshes"][mesh]
    assert run["losses"] == pytest.approx(eager["losses"], abs=TOL)
    assert run["grad_diff_first"] < TOL and run["grad_diff_last"] < TOL, (run["grad_diff_first"], run["grad_diff_last"])
    assert run["param_diff"] < TOL, f"params after {STEPS} steps differ by {run['param_diff']}"
    assert run["dropped"] == eager["dropped"] == [0.0] * STEPS


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.parametrize("mesh", LATENT_MESHES)
def test_latent_attention_step_matches_single_device(runs, mesh):
    eager, run = runs["deepseek_v3"]["eager"], runs["deepseek_v3"]["meshes"][mesh]
    assert run["losses"] == pytest.approx(eager["losses"], abs=TOL)
    assert max(run["grad_diff_first"], run["grad_diff_last"], run["param_diff"]) < TOL
    assert run["per_step_compiles"] == [1] + [0] * (STEPS - 1)


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_dropping_step_drops_what_single_device_drops(runs, mesh):
    eager, run = runs["dropping"]["eager"], runs["dropping"]["meshes"][mesh]
    assert min(eager["dropped"]) > 0.25  # half an even share of slots: about 45% of the pairs find no slot
    assert run["dropped"] == eager["dropped"] and run["max_load"] == eager["max_load"]  # same routing, same slots
    assert run["losses"] == pytest.approx(eager["losses"], abs=TOL)
    assert max(run["grad_diff_first"], run["grad_diff_last"], run["param_diff"]) < TOL


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_step_compiles_once_while_the_routing_changes(runs, mesh, config):
    """Shapes depend on the config only (static capacity), so new routings reuse the compiled step."""
    run = runs[config]["meshes"][mesh]
    assert len(set(run["max_load"])) > 1, f"the routing did not change over the steps: {run['max_load']}"
    assert run["per_step_compiles"] == [1] + [0] * (STEPS - 1)


def _is_buffer(dims, capacity):
    """A result shaped like a piece of the (G, E, C, d) dispatch buffer: trailing (C, d)."""
    return len(dims) >= 2 and tuple(dims[-2:]) == (capacity, D_MODEL)


@pytest.mark.xla
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_token_exchange_is_an_all_to_all_within_ep(runs, mesh, config):
    """Per MoE layer: tokens to their experts and back in the forward, both again in the backward."""
    found, capacity = runs[config]["meshes"][mesh]["collectives"], CAPACITY[config]
    ep = int(dict(a.split("=") for a in mesh.split(","))["ep"])
    exchanges = found.get("all-to-all", [])
    assert len(exchanges) == 4 * MOE_LAYERS, exchanges
    assert all(all(_is_buffer(d, capacity) for d in op["dims"]) and op["group"] == ep for op in exchanges), exchanges
    for kind in ("all-gather", "reduce-scatter", "collective-permute"):
        gathered = [op for op in found.get(kind, []) if any(_is_buffer(d, capacity) for d in op["dims"])]
        assert not gathered, f"{mesh}: the dispatch buffer goes through {kind}: {gathered}"
    if mesh == "ep=2":  # ep alone is data parallel outside the experts: nothing else to gather
        assert sorted(found) == ["all-reduce", "all-to-all"]
