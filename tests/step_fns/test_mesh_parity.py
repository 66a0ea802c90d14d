"""Token weighting and the chunked loss on 2-device meshes equal one device (`_mesh_parity.py`).

- `token_weighting`, dp=2: rank 0's rows hold more valid tokens than rank 1's; the sharded step
  with 1 and 2 microbatches gives the single-device loss, count and gradients, and on DTensor each
  microbatch stays split over the two ranks.
- `chunked_loss`, tp=2: a Llama whose head is sharded over the vocabulary, with `loss_chunk_size`
  and its blocks rematerialised, gives the plain (unchunked) loss and gradients of one device.

Each on DTensor over gloo with 2 processes (eager and Inductor) and on torch_xla SPMD with 2
virtual CPU devices, within 1e-5.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import _token_weighting
from _token_weighting import make_case

WORKER = pathlib.Path(__file__).with_name("_mesh_parity.py")


def run_worker(kind, case, out):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2") if kind == "xla" else dict(os.environ)
    proc = subprocess.run([sys.executable, str(WORKER), kind, case, str(out)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


def check_against_reference(results, backends):
    seeds = sorted({k.split("/")[0] for k in results})
    for seed in seeds:
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


def test_token_weighting_case_gives_ranks_different_counts():
    for seed in (0, 1, 2):
        valid = (make_case(seed)[1]["y"] != -100).sum(dim=1)
        assert int(valid[:4].sum()) != int(valid[4:].sum())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["token_weighting", "chunked_loss"])
def test_dtensor_mesh_matches_one_device(case, tmp_path):
    results = run_worker("dtensor", case, tmp_path)
    check_against_reference(results, ("eager", "inductor"))
    if case == "token_weighting":  # a microbatch's rows stay split over dp: B / (m * 2) per device
        for key, got in results.items():
            if not key.endswith("/reference"):
                m = int(key.rsplit("/", 1)[1])
                assert got["rows"] == [_token_weighting.B // (2 * m)], (key, got["rows"])


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.parametrize("case", ["token_weighting", "chunked_loss"])
def test_xla_spmd_mesh_matches_one_device(case, tmp_path):
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    check_against_reference(run_worker("xla", case, tmp_path), ("xla",))
