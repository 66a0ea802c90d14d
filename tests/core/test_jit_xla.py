"""ember.core.jit(backend="xla") and ember.core.xla, run in subprocesses.

torch_xla fixes its device type and count when its runtime starts, and other tests need other
counts, so every torch_xla run here is a fresh `python _xla_scripts/<script>.py` that prints one
JSON object; one subprocess serves several assertions.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from ember.core import xla as ember_xla

pytestmark = pytest.mark.xdist_group("jit_xla")  # one worker runs the module: its shared fixture runs once

SCRIPTS = pathlib.Path(__file__).parent / "_xla_scripts"
STEPS = 20
TOL = 1e-5  # float32: XLA fuses and reorders the same ops (observed diff ~6e-8)

def _run_script(name: str, env: dict) -> dict:
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla], or make install)")
    proc = subprocess.run([sys.executable, str(SCRIPTS / name)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def step_run():
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    return _run_script("jit_step.py", env)


@pytest.fixture(scope="module")
def devices_run():
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    return _run_script("xla_devices.py", env)


def _assert_params_close(got: dict, want: dict):
    for k in want:
        flat_got = [v for row in got[k] for v in (row if isinstance(row, list) else [row])]
        flat_want = [v for row in want[k] for v in (row if isinstance(row, list) else [row])]
        assert flat_got == pytest.approx(flat_want, abs=TOL), k


@pytest.mark.xla
@pytest.mark.parametrize("donate", ["none", "state"])
def test_xla_matches_eager_over_20_steps(step_run, donate):
    run = step_run[donate]
    assert len(run["losses"]) == STEPS
    assert run["losses"] == pytest.approx(step_run["eager_losses"], abs=TOL)
    _assert_params_close(run["params_20"], step_run["eager_params_20"])


@pytest.mark.xla
@pytest.mark.parametrize("donate", ["none", "state"])
def test_xla_compiles_on_first_step_only(step_run, donate):
    """Exact behaviour: 1 compile at call 1 (inputs synced first), then 0 more, even after an lr change."""
    run = step_run[donate]
    assert run["per_step_compiles"] == [1] + [0] * (STEPS - 1)
    assert run["counts"] == {"after_1": 1, "after_20": 1, "after_lr_change": 1}


@pytest.mark.xla
@pytest.mark.parametrize("donate", ["none", "state"])
def test_xla_host_uploaded_scalar_state_compiles_once(step_run, donate):
    """0-d hyperparameters uploaded from the host (cached, read-only, shared with the step's equal
    constants in torch_xla) used to make call 2 compile again: [1, 1, 0, ...]; a later upload of a
    new value too. jit gives such inputs their own buffers, so only call 1 compiles."""
    assert step_run["host_scalars_compiles_per_step"][donate] == [1] + [0] * 7


@pytest.mark.xla
def test_xla_donation_updates_the_donated_tensors(step_run):
    run = step_run["state"]
    assert run["same_tensors"], "the returned state must hold the donated tensor objects"
    assert run["aliased_buffers"] > 0, "torch_xla should alias the donated input buffers to outputs"
    assert step_run["none"]["aliased_buffers"] == 0
    _assert_params_close(run["params_20"], step_run["none"]["params_20"])


@pytest.mark.xla
def test_xla_rejects_cpu_tensors_with_the_path(step_run):
    msg = step_run["cpu_input_error"]
    assert msg is not None and "args.1.0 is on cpu" in msg and "torch_xla.device()" in msg


@pytest.mark.xla
def test_xla_cpu_devices_sets_env_and_count(devices_run):
    assert devices_run["initialized_before"] is False
    assert devices_run["env"] == ["CPU", "3"]
    assert devices_run["initialized_after"] is True
    assert devices_run["device_count"] == 3
    assert devices_run["same_count_again"] is None  # same count after init: a no-op


@pytest.mark.xla
def test_xla_cpu_devices_refuses_a_different_count_after_init(devices_run):
    kind, msg = devices_run["other_count"]
    assert kind == "RuntimeError"
    assert "xla_cpu_devices(2)" in msg and "3 device(s)" in msg and "fresh process" in msg


@pytest.mark.xla
def test_backward_before_runtime_start_does_not_break_xla_backward(devices_run):
    """pytorch/xla#4174: a CPU backward before the runtime started broke every XLA backward."""
    assert devices_run["autograd_order"] == [2.0, 2.0]  # d/dp sum(p**2) at p = 1


@pytest.mark.xla
def test_the_backward_order_trap_is_still_there_without_the_guard(devices_run):
    """When this fails, torch / torch_xla fixed pytorch/xla#4174: drop ember.core.xla.autograd_guard."""
    kind, msg = devices_run["unguarded"] or (None, "no error: the trap is fixed upstream")
    assert kind == "RuntimeError" and "device_ready_queues_" in msg, msg


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_xla_cpu_devices_validates_n(bad, exc):
    with pytest.raises(exc, match=r"xla_cpu_devices\(n\)"):
        ember_xla.xla_cpu_devices(bad)
