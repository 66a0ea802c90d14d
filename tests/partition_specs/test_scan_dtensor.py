"""`scan` and `remat_scan` over DTensors compiled by ember's `jit` (2 gloo processes): one `scan` node each way
in the step's graph whatever the depth, the layers' collectives inside the loop's body, one device's gradients
on every process, the same bits twice; where dim 0 of the stack is split (no local slice), and on torch 2.9 and
2.10 (`compat` entry `dtensor_scan`, where this module is skipped), the Python loop."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _scan_dtensor_worker as W  # noqa: E402
from _gloo_runs import run_worlds  # noqa: E402

from ember.core.compat import gated_on  # noqa: E402

pytestmark = [pytest.mark.xdist_group("scan_dtensor"),  # one worker runs the module: its processes start once
              pytest.mark.skipif(gated_on("dtensor_scan"), reason="DTensor loops run unrolled on torch 2.9, 2.10 "
                                 "(compat entry dtensor_scan); the mesh parity tests check that path")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_worlds(W.__file__, W.CASES, tmp_path_factory, "scan_dtensor")


@pytest.mark.parametrize("case", sorted(W.CASES[2]))
def test_scan_over_dtensors_rolls_and_equals_one_device(runs, case):
    for rank in range(2):
        res = runs[2, rank][case]
        assert "error" not in res, f"{case} failed in the worker on rank {rank}:\n{res.get('error')}"
        for depth in ("4", "8"):
            at = res[depth]
            assert at["error"] < 1e-5, (case, rank, depth, at)
            assert at["same_bits"], (case, rank, depth)
            # rolled: a forward loop and its backward, at either depth; a split layer axis runs the Python loop
            assert at["scan_nodes"] == (0 if case == "layers_split" else 2), (case, depth, at["scan_nodes"])
