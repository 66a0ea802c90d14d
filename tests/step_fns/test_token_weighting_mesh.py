"""Token weighting across data-parallel ranks: a dp=2 mesh equals one device.

Rank 0's half of the batch holds more valid tokens than rank 1's. The sharded step,
eager and compiled, with 1 and 2 microbatches, gives the single-device loss, count and gradients
within 1e-5: DTensor over gloo with 2 processes, and torch_xla SPMD on 2 virtual CPU devices.
Runs `_token_weighting_mesh.py` in subprocesses.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from _token_weighting import SEEDS, make_case

WORKER = pathlib.Path(__file__).with_name("_token_weighting_mesh.py")


def check_against_reference(results, backends):
    for seed in SEEDS:
        _, batch = make_case(seed)
        valid = (batch["y"] != -100).sum(dim=1)
        assert int(valid[:4].sum()) != int(valid[4:].sum())  # the two ranks hold different counts
        ref = results[f"{seed}/reference"]
        for backend in backends:
            for m in (1, 2):
                got = results[f"{seed}/{backend}/{m}"]
                where = f"seed {seed}, {backend}, microbatches={m}"
                assert got["tokens"] == ref["tokens"], where
                assert abs(got["loss"] - ref["loss"]) < 1e-5, (where, got["loss"], ref["loss"])
                for name in ref["grads"]:
                    torch.testing.assert_close(torch.tensor(got["grads"][name]), torch.tensor(ref["grads"][name]),
                                               rtol=1e-5, atol=1e-5, msg=f"grad {name}, {where}")


def run_worker(kind, out, env):
    proc = subprocess.run([sys.executable, str(WORKER), kind, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_dtensor_dp2_matches_one_device(tmp_path):
    results = run_worker("dtensor", tmp_path, dict(os.environ))
    check_against_reference(results, ("eager", "inductor"))


@pytest.mark.slow
@pytest.mark.xla
def test_xla_spmd_dp2_matches_one_device(tmp_path):
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    results = run_worker("xla", tmp_path, dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2"))
    check_against_reference(results, ("xla",))
