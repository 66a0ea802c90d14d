"""A tiny Llama with its sequence split over `cp` (DTensor, gloo): each sequence in the head-tail order of
`ember.data.ContextOrder`, the step's gradients, SGD losses and final parameters equal one device's on the
natural order (eagerly, with packed documents and padding, beside `fsdp` and `tp`; compiled, under torchrun,
in tests/launch/test_torchrun_pp_cp.py), on every process; the only all-gathers are of
the keys and values (and of the keys' positions and segment ids), and the keys' and values' gradients come
back reduce-scattered. Where this torch's DTensor cannot fold a split sequence (`compat` entry
`dtensor_sequence_fold`, torch 2.9 to 2.11), context parallelism refuses, naming the fix."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _context_dtensor_worker as W  # noqa: E402
from _gloo_runs import one_device, run_worlds  # noqa: E402

from ember.core.compat import gated_on  # noqa: E402
from ember.core.partition_specs.context_parallel import check_dtensor_can_split_sequences  # noqa: E402

REFUSED = gated_on("dtensor_sequence_fold")
pytestmark = pytest.mark.xdist_group("context_dtensor")  # one worker runs the module: its fixtures run once
needs_fold = pytest.mark.skipif(REFUSED, reason="context parallelism refuses on this torch (dtensor_sequence_fold)")
ATOL = 1e-5
CASES = [(world, name) for world, cases in W.CASES.items() for name in cases]


@pytest.fixture(scope="module")
def references():
    return {packed: one_device(W.setup(packed)) for packed in (False, True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_worlds(W.__file__, W.CASES, tmp_path_factory, "context_dtensor")


@pytest.mark.skipif(not REFUSED, reason="this torch's DTensor folds a split sequence")
def test_cp_refuses_naming_the_fix_where_dtensor_cannot_fold_a_split_sequence():
    with pytest.raises(ValueError, match=r"upgrade torch to 2.12 or newer, or run cp under torch_xla"):
        check_dtensor_can_split_sequences()


@needs_fold
@pytest.mark.slow
@pytest.mark.parametrize("world,case", CASES)
def test_cp_step_equals_one_device_on_every_process(runs, references, world, case):
    packed = W.CASES[world][case][1]
    ref = references[packed]
    for rank in range(world):
        res = runs[world, rank][case]
        assert "error" not in res, f"{case} failed in the worker on rank {rank}:\n{res['error']}"
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=ATOL)
        for path, want in ref["grads"].items():
            torch.testing.assert_close(torch.tensor(res["grads"][path]), want, rtol=0, atol=ATOL, msg=path)
        for path, want in ref["params"].items():
            torch.testing.assert_close(torch.tensor(res["params"][path]), want, rtol=0, atol=ATOL, msg=path)


@needs_fold
@pytest.mark.slow
def test_cp_gathers_only_the_keys_and_values(runs):
    """Per layer: one all-gather of the keys and one of the values, `(B, KV, T / cp, D)` each (the grouped-query
    heads repeated after the gather), reduce-scattered
    back in the backward; the keys' token tensors (ints, `(B, T / cp)`) once per layer each; no other
    all-gather (the rest is the gradients' all-reduce over `cp`, as over a batch axis)."""
    layers, b, t, cp = W.LLAMA["n_layers"], W.BATCH, W.SEQ, 2
    kv = b * W.LLAMA["n_kv_heads"] * (t // cp) * (W.LLAMA["d_model"] // W.LLAMA["n_heads"])
    for case, tokens in (("cp=2", 1), ("cp=2 packed", 2)):  # the keys' positions (and packed, segment ids)
        got = runs[2, 0][case]["collectives"]
        gathers = {k: n for k, n in got.items() if k.startswith("all_gather")}
        want = {f"all_gather x {kv}": 2 * layers}
        want[f"all_gather x {b * t // cp}"] = tokens * layers
        assert gathers == want, got
        assert got[f"reduce_scatter x {kv * cp}"] == 2 * layers, got
