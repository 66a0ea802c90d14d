"""Checkpoints are portable across meshes: one device, DTensor `dp=2,tp=2` / `fsdp=4`, torch_xla SPMD.

One launch per kind of world (`_ckpt_mesh_worker.py`): a single-device run trains one step of a
tiny Llama and saves it (here, in the test process); 4 gloo processes restore it on `dp=2,tp=2`
and `fsdp=4` (each process reading only its own shards, through jax.distributed), then train one
step on `dp=2,tp=2` and save it with every process writing its own shards of one checkpoint,
which they restore on `fsdp=4` and `dp=2,tp=2`; one torch_xla process (4 virtual CPU devices)
restores both checkpoints on `fsdp=2,tp=2`; the test process restores the multi-process one on
one device. Every restore must give back the saved parameters and, over two more steps, the
losses of the run that never stopped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ckpt_mesh_worker as W  # noqa: E402

from ember.core.checkpoint import CheckpointManager  # noqa: E402
from ember.core.step_fns import train_step  # noqa: E402
from ember.models import lm_loss  # noqa: E402

pytestmark = pytest.mark.xdist_group("checkpoint_mesh")  # one worker runs the module: its shared fixture runs once

# float32 sums over shards run in another order than on one device (measured below 2e-6).
LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-5
F, D = W.LLAMA["ffn_dim"], W.LLAMA["d_model"]
L = W.LLAMA["n_layers"]  # the blocks stacked: the layers axis first, whole
PROBE_LOCAL = {"dp=2,tp=2": [L, F // 2, D], "fsdp=4": [L, F, D // 4], "fsdp=2,tp=2": [L, F // 2, D // 2]}


def _run(cmd, env=None, timeout=900):  # a hang guard: a cold Inductor cache beside another test took over 300 s
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, W.__file__, *cmd], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-device reference and checkpoint, then the DTensor and XLA launches (about 60 s on 2 cores)."""
    root = tmp_path_factory.mktemp("ckpt_mesh")
    out, single, multi = root / "out", root / "single", root / "multi"
    model, tx, state, batches = W.setup()
    step = train_step(lm_loss(model), tx)
    state1, m0 = step(state, batches[0])
    with CheckpointManager(single) as ckpt:
        ckpt.save(1, state1, metrics={"loss": m0["loss"]})
    losses, s = [], state1
    for b in W.after(batches):
        s, m = step(s, b)
        losses.append(float(m["loss"]))
    res = {"ref_losses": losses, "ref_params": W.params_of(state1), "out": out, "multi": multi, "model": model, "tx": tx}
    res["dtensor_s"] = _run(["dtensor", str(out), str(single), str(multi)])
    with open(out / "dtensor.json") as f:
        res["dtensor"] = json.load(f)
    if importlib.util.find_spec("torch_xla") is not None and (multi / "1").is_dir():
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
        res["xla_s"] = _run(["xla", str(out), str(single), str(multi)], env=env)
        with open(out / "xla.json") as f:
            res["xla"] = json.load(f)
    return res


def _result(runs, kind, name):
    got = runs.get(kind)
    if got is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla])")
    for key in ("error", "single_error", f"{name.split('->')[0]}_error"):
        assert key not in got, f"{kind} worker failed:\n{got[key]}"
    return got[name]


def _assert_params(runs, file, want):
    got = torch.load(runs["out"] / file)
    assert sorted(got) == sorted(want)
    for path, x in want.items():
        torch.testing.assert_close(got[path], x, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{file} {path}: {m}")


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "fsdp=4"])
def test_single_device_checkpoint_restores_on_a_dtensor_mesh(runs, mesh):
    res = _result(runs, "dtensor", f"single->{mesh}")
    assert res["step"] == 1 and res["local"] == PROBE_LOCAL[mesh]  # placed as the layout says
    _assert_params(runs, f"single_on_{mesh}.pt", runs["ref_params"])
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(runs["ref_losses"]), rtol=0, atol=LOSS_ATOL)


@pytest.mark.xla
@pytest.mark.parametrize("name", ["single", "multi"])
def test_checkpoint_restores_under_xla_spmd(runs, name):
    res = _result(runs, "xla", f"{name}->fsdp=2,tp=2")
    assert res["local"] == PROBE_LOCAL["fsdp=2,tp=2"]
    want = runs["ref_params"] if name == "single" else torch.load(runs["out"] / "multi_saved.pt")
    _assert_params(runs, f"{name}_on_xla.pt", want)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(runs["ref_losses"]), rtol=0, atol=LOSS_ATOL)


def test_multi_process_save_writes_one_checkpoint_from_every_process(runs):
    res = runs["dtensor"]
    assert "error" not in res, res["error"]
    assert [f"ocdbt.process_{r}" for r in range(4)] == [f for f in res["process_files"] if f.startswith("ocdbt.process_")]
    # Each process wrote a part of the parameters, none all of them (orbax spreads replicated shards too).
    assert all(0 < n < res["params_bytes"] for n in res["process_bytes"].values()), (res["process_bytes"], res["params_bytes"])
    # The multi-process checkpoint holds the same parameters the mesh trained (compared exactly).
    with CheckpointManager(runs["multi"], read_only=True) as ckpt:
        meta = ckpt.read_meta()
        params = ckpt.restore_params()
    assert meta.step == 1 and all(leaf.crc32 is None for leaf in meta.leaves)
    saved = torch.load(runs["out"] / "multi_saved.pt")
    assert sorted(params) == sorted(saved)
    for path, x in saved.items():
        assert torch.equal(params[path], x), path


@pytest.mark.parametrize("mesh", ["fsdp=4", "dp=2,tp=2"])
def test_multi_process_checkpoint_restores_on_a_dtensor_mesh(runs, mesh):
    res = _result(runs, "dtensor", f"multi->{mesh}")
    assert res["step"] == 1 and res["local"] == PROBE_LOCAL[mesh]
    saved = torch.load(runs["out"] / "multi_saved.pt")
    _assert_params(runs, f"multi_on_{mesh}.pt", saved)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(runs["dtensor"]["multi_saved"]["losses"]),
                               rtol=0, atol=LOSS_ATOL)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(runs["ref_losses"]), rtol=0, atol=LOSS_ATOL)


def test_multi_process_save_of_uneven_shards_and_pending_sums(runs):
    """5 rows over 4 ranks (DTensor's uneven chunks; jax needs equal shards) are saved whole; a pending
    sum (`Partial`) is summed first."""
    assert "error" not in runs["dtensor"], runs["dtensor"]["error"]
    with CheckpointManager(runs["out"] / "odd", read_only=True) as ckpt:
        params = ckpt.restore_params()
    assert torch.equal(params["odd"], torch.arange(10.0).reshape(5, 2))
    assert torch.equal(params["pending"], torch.arange(6.0) * 10)


def test_multi_process_checkpoint_restores_on_one_device(runs):
    model, tx = runs["model"], runs["tx"]
    like = W.setup(seed=7)[2]
    with CheckpointManager(runs["multi"], read_only=True) as ckpt:
        state, _, meta = ckpt.restore(like=like)
    got = W.params_of(state)
    for path, x in torch.load(runs["out"] / "multi_saved.pt").items():
        assert torch.equal(got[path], x), path
    step, losses = train_step(lm_loss(model), tx), []
    for b in W.after(W.setup()[3]):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(runs["ref_losses"]), rtol=0, atol=LOSS_ATOL)
