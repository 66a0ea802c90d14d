"""Running a gloo worker script once per world size and reading back what each of its ranks wrote.

A worker (`_context_dtensor_worker.py`, `_pipeline_dtensor_worker.py`) takes `--world N --out DIR`, spawns N
processes and has every rank write `DIR/results_<rank>.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, Iterable, Tuple


def run_worlds(worker: str, worlds: Iterable[int], tmp_path_factory, name: str,
               timeout: int = 1200) -> Dict[Tuple[int, int], dict]:
    """`{(world, rank): that rank's results}` for each world size, the worker in its own session."""
    results = {}
    for world in worlds:
        out = tmp_path_factory.mktemp(f"{name}_{world}")
        proc = subprocess.run([sys.executable, worker, "--world", str(world), "--out", str(out)],
                              capture_output=True, text=True, timeout=timeout, start_new_session=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        for rank in range(world):
            with open(os.path.join(out, f"results_{rank}.json")) as f:
                results[world, rank] = json.load(f)
    return results


def one_device(setup: tuple) -> dict:
    """The reference of a worker's cases: `setup`'s `(model, tx, state, batches, loss_fn)` on one device, the
    first batch's gradients, each step's loss and the final parameters."""
    from _moe_dtensor_worker import grads_of

    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step

    model, tx, state, batches, loss_fn = setup
    grads = dict(tree_leaves_with_path(grads_of(loss_fn, state.params, batches[0])))
    step, losses = train_step(loss_fn, tx), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return {"grads": grads, "losses": losses, "params": dict(tree_leaves_with_path(state.params))}
