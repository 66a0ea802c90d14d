"""Every remat policy, with and without `scan_layers`, trains like the unrolled remat-free model.

Two `train_step`s (microbatches=2, some targets ignored) of tiny Llama-3, GPT-2, Qwen3-MoE and DeepSeek-V3 (a dense
block, then MoE ones: two stacks) models from the
same weights: metrics and updated params within 1e-5 of the reference, on eager (every variant),
Inductor and XLA (one variant per policy; see `_remat_scan_parity.py`).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from _remat_scan_parity import COMPILED_VARIANTS, run

FAMILIES = tuple(COMPILED_VARIANTS)

SCRIPT = pathlib.Path(__file__).with_name("_remat_scan_parity.py")
TOL = 1e-5


def check(results):
    for variant, diff in results.items():
        assert diff["metrics"] < TOL and diff["params"] < TOL, (variant, diff)


@pytest.mark.parametrize("family", FAMILIES)
def test_policies_and_scan_match_unrolled_eager(family):
    check(run(family, "eager"))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_policies_and_scan_match_unrolled_inductor(family):
    check(run(family, "inductor", COMPILED_VARIANTS[family]))


@pytest.mark.slow
@pytest.mark.xla
def test_policies_and_scan_match_unrolled_xla():
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "xla"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == set(COMPILED_VARIANTS)
    for family, variants in results.items():
        assert list(variants) == COMPILED_VARIANTS[family]
        check(variants)
