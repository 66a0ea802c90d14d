"""Subprocess body for tests/core/test_jit_xla.py: `xla_cpu_devices` and runtime-order errors.

Run with PJRT_DEVICE and CPU_NUM_DEVICES unset. Prints one JSON object on its last stdout line.
"""

from __future__ import annotations

import json
import os

import torch

from ember.core import xla as ember_xla
from ember.core.jit import jit


def _error(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test inspects type and message
        return [type(err).__name__, str(err)]
    return None


def main():
    out = {"initialized_before": ember_xla.is_runtime_initialized()}
    ember_xla.xla_cpu_devices(3)
    out["env"] = [os.environ.get("PJRT_DEVICE"), os.environ.get("CPU_NUM_DEVICES")]

    import torch_xla
    import torch_xla.runtime as xr

    # A CPU backward before the runtime starts: autograd sizes its device queues now, with 0 XLA
    # devices; a later backward on XLA tripped an internal assert until jit ran it under
    # ember.core.xla.autograd_guard.
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()

    dev = torch_xla.device()
    out["initialized_after"] = ember_xla.is_runtime_initialized()
    out["device_count"] = xr.global_runtime_device_count()
    out["same_count_again"] = _error(lambda: ember_xla.xla_cpu_devices(3))
    out["other_count"] = _error(lambda: ember_xla.xla_cpu_devices(2))

    grad_step = jit(lambda p: torch.func.grad(lambda q: (q ** 2).sum())(p), backend="xla")
    try:
        out["autograd_order"] = grad_step(torch.ones(2).to(dev)).cpu().tolist()
    except RuntimeError as err:  # the test shows the message
        out["autograd_order"] = [type(err).__name__, str(err)]
    # The trap itself, without ember's guard: the test notices when a release fixes it.
    out["unguarded"] = _error(lambda: torch.func.grad(lambda q: (q ** 2).sum())(torch.ones(2).to(dev)))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
