"""`xla_scan` (core/compat/xla_loop.py) survives a tensor whose buffer arrives while the loop is lowered.

torch_xla looks each tensor the body reads up twice by its handle, and a tensor still being computed
changes handle when its buffer arrives (seen once in CI under load). The race cannot be timed from
Python, so torch_xla's failure is injected on the first trace: the loop must wait and trace again,
while any other error still propagates. Runs in a subprocess, as every torch_xla test here.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, torch, torch_xla
import torch_xla.experimental.scan as upstream
from ember.core.compat.xla_loop import xla_scan

real, calls = upstream._scan_impl_pytree, []

def racy(fn, init, xs):
    calls.append(1)
    real(fn, init, xs)  # the first trace runs in full, as in the race, then fails late
    if len(calls) == 1:
        raise RuntimeError("Check failed: param_id.has_value(): Parameter ID must exist for device data")
    return real(fn, init, xs)

upstream._scan_impl_pytree = racy
dev = torch_xla.device()
h, ws, scale = torch.randn(3, 4), torch.randn(5, 4, 4), torch.tensor(0.5)
want = h
for w in ws:
    want = torch.tanh(want @ w) * scale
body = lambda c, w: (torch.tanh(c @ w) * scale.to(dev), None)
last, _ = xla_scan(body, h.to(dev), ws.to(dev))
torch.testing.assert_close(last.cpu(), want, rtol=1e-5, atol=1e-5)

def broken(fn, init, xs):
    raise RuntimeError("something else")

upstream._scan_impl_pytree = broken
try:
    xla_scan(body, h.to(dev), ws.to(dev))
    other = "swallowed"
except RuntimeError as err:
    other = str(err)
print(json.dumps({"traces": len(calls), "other": other}))
"""


@pytest.mark.xla
def test_a_handle_that_moves_while_lowering_is_traced_again_after_the_device_is_idle():
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"traces": 2, "other": "something else"}
