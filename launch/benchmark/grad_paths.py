"""Child-process measurement for `launch/bench_scale.py --grad-paths`: one step, its gradient taken two ways.

Public names: `grad_paths_child`.

The same compiled train step built twice in one process: traced with the gradient by
`torch.autograd.grad` (ember's `grad` today) and with it by `torch.func.grad` (what `grad` does inside
a `torch.func` transform, forced here for the whole trace), then timed alternately, so the two
graphs are compared without the noise between processes.
"""

from __future__ import annotations

import time
from typing import Any, Dict
from unittest import mock

import ember.core.transforms as transforms

from .scaling import _step_and_inputs

PATHS = ("torch.func.grad", "torch.autograd.grad")


def grad_paths_child(config: Any, *, rounds: int = 5, calls: int = 5) -> Dict[str, Any]:
    """First call seconds (the first path compiles with a cold cache, the second with a warmer one),
    median warm step seconds and the loss after 3 calls, per path."""
    runs = {}
    for path in PATHS:
        step, state, batch = _step_and_inputs(config, backend="inductor", donate="state")
        forced = (lambda: True) if path == "torch.func.grad" else transforms.any_transform_active
        with mock.patch.object(transforms, "any_transform_active", forced):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            first = time.perf_counter() - start
        for _ in range(2):
            state, metrics = step(state, batch)
        runs[path] = {"step": step, "state": state, "batch": batch, "first": first, "loss": float(metrics["loss"]),
                      "times": []}
    for _ in range(rounds):
        for run in runs.values():
            start = time.perf_counter()
            for _ in range(calls):
                run["state"], metrics = run["step"](run["state"], run["batch"])
            float(metrics["loss"])  # host sync
            run["times"].append((time.perf_counter() - start) / calls)
    return {path: {"first_call_s": r["first"], "step_s": sorted(r["times"])[rounds // 2], "loss": r["loss"]}
            for path, r in runs.items()}
