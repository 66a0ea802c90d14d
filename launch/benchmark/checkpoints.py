"""Checkpoint save / restore methods timed by `launch/bench_ckpt.py`: ember (orbax), torch.save, DCP."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed.checkpoint as dcp

from ember import optim
from ember.core import TrainState, random
from ember.core.checkpoint import CheckpointManager
from ember.core.pytree import tree_map
from ember.models import build_model

__all__ = ["build_state", "methods", "time_methods"]


def build_state(layers: int) -> TrainState:
    """A llama3 125m-shaped TrainState with `layers` layers, after one AdamW update."""
    model = build_model("llama3", "125m", n_layers=layers)
    state = TrainState.create(params=model.init(random.key(0)), tx=optim.adamw(1e-4))
    grads = tree_map(lambda p: torch.randn_like(p) * 1e-3, state.params)
    return state.apply_gradients(grads=grads)  # non-zero mu / nu, as in a real run


def methods(state: TrainState, flat: Dict[str, torch.Tensor]) -> Tuple[Dict[str, Callable], Dict[str, Tuple[str, Callable]]]:
    """`(saves, restores)`: name -> `save(dir) -> (blocking_s, committed_s)`; name -> (the save it reads, `restore(dir)`)."""
    def ember(async_save, checksums=True, compress=False):
        def run(d):
            ckpt = CheckpointManager(d, async_save=async_save, checksums=checksums, compress=compress)
            t0 = time.perf_counter()
            ckpt.save(1, state, force=True)
            t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            ckpt.close()
            return t1 - t0, t2 - t0
        return run

    def torch_save(d):
        t0 = time.perf_counter()
        with open(os.path.join(d, "state.pt"), "wb") as f:
            torch.save(flat, f)
            f.flush()
            os.fsync(f.fileno())
        t = time.perf_counter() - t0
        return t, t

    def dcp_save(d):
        t0 = time.perf_counter()
        dcp.save(flat, checkpoint_id=d, no_dist=True)
        t = time.perf_counter() - t0
        return t, t

    def dcp_async(d):
        t0 = time.perf_counter()
        fut = dcp.async_save(flat, checkpoint_id=d, no_dist=True)
        t1 = time.perf_counter()
        fut.result()
        return t1 - t0, time.perf_counter() - t0

    saves = {"ember sync": ember(False), "ember async": ember(True), "ember async, no CRC": ember(True, False),
             "ember async, zstd": ember(True, compress=True),
             "torch.save": torch_save, "DCP save": dcp_save, "DCP async_save": dcp_async}

    def ember_restore(d):
        with CheckpointManager(d, read_only=True) as ckpt:
            ckpt.restore(like=state)

    def ember_params(d):
        with CheckpointManager(d, read_only=True) as ckpt:
            ckpt.restore_params(like=state.params)

    def dcp_load(d):
        target = {k: torch.empty_like(v) for k, v in flat.items()}
        dcp.load(target, checkpoint_id=d, no_dist=True)

    restores = {"ember restore": ("ember sync", ember_restore), "ember restore_params": ("ember sync", ember_params),
                "ember restore, zstd": ("ember async, zstd", ember_restore),
                "torch.load": ("torch.save", lambda d: torch.load(os.path.join(d, "state.pt"), weights_only=True)),
                "DCP load": ("DCP save", dcp_load)}
    return saves, restores


def time_methods(saves: Dict[str, Callable], restores: Dict[str, Tuple[str, Callable]], *, repeats: int,
                 directory: str) -> Dict[str, List[Tuple[float, float]]]:
    """`{method: [(blocking_s, committed_s)] * repeats}`, every method once per round, in a rotating order."""
    times: Dict[str, List[Tuple[float, float]]] = {name: [] for name in [*saves, *restores]}
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=directory)
    try:
        names = list(saves)
        for r in range(repeats):
            dirs = {}
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate: no method always goes first
                fn = saves[name]
                dirs[name] = os.path.join(root, name.replace(" ", "_").replace(",", ""))
                os.makedirs(dirs[name])
                times[name].append(fn(dirs[name]))
            for name, (source, fn) in restores.items():
                t0 = time.perf_counter()
                fn(dirs[source])
                times[name].append((time.perf_counter() - t0,) * 2)
            for d in dirs.values():
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return times
