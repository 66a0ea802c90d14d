"""Gloo worker scripts: their command line (`serve`), running one per world size and reading back what each
of its ranks wrote (`run_worlds`), and the one-device reference of their cases (`one_device`).

A worker (`_context_dtensor_worker.py`, `_pipeline_dtensor_worker.py`) takes `--world N --out DIR`, spawns N
processes and has every rank write `DIR/results_<rank>.json`.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable, Dict, Iterable, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _processes
from _processes import end_gloo_rank, run_in_own_group  # noqa: E402


def run_worlds(worker: str, worlds: Iterable[int], tmp_path_factory, name: str,
               timeout: int = 1800) -> Dict[Tuple[int, int], dict]:
    """`{(world, rank): that rank's results}` for each world size, the worker in its own session."""
    results = {}
    for world in worlds:
        out = tmp_path_factory.mktemp(f"{name}_{world}")
        proc = run_in_own_group([sys.executable, worker, "--world", str(world), "--out", str(out)], timeout=timeout)
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


def _serve_rank(rank: int, world: int, out: str, cases: Dict[str, tuple], run: Callable[..., dict]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), world), rank=rank,
                            world_size=world)
    results = {}
    for name, (mesh_text, *options) in cases.items():
        try:
            results[name] = run(mesh_text, world, *options)
        except Exception:  # report every case, not only the first failure
            results[name] = {"error": traceback.format_exc()[-4000:]}
    with open(os.path.join(out, f"results_{rank}.json"), "w") as f:  # every rank: none may drift
        json.dump(results, f)
    end_gloo_rank()


def serve(cases: Dict[int, Dict[str, tuple]], run: Callable[..., dict], description: str) -> None:
    """A worker's command line, `--world N --out DIR`: N gloo processes, each running `run(mesh, N, *options)`
    for every case `name: (mesh, *options)` of `cases[N]` and writing `DIR/results_<rank>.json`."""
    import argparse

    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--world", type=int, choices=sorted(cases), required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
    mp.start_processes(_serve_rank, args=(args.world, args.out, cases[args.world], run), nprocs=args.world,
                       start_method="spawn")
