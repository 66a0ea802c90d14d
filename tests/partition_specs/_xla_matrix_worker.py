"""Subprocess body for tests/partition_specs/test_xla_matrix.py: a tiny Llama trained on several
torch_xla SPMD meshes in one process, each against the single-device eager reference.

Run with `PJRT_DEVICE=CPU CPU_NUM_DEVICES=N python _xla_matrix_worker.py MESH [MESH ...]`, every
mesh of size N (a torch_xla mesh must cover all devices). Prints one JSON object on its last
stdout line: the eager reference losses and, per mesh, the losses, the compiles per step, the
local shard shape of every parameter and optimizer-state tensor as the device reports it and as
`report.sharding_table` predicts it, the largest parameter difference after training, the
sharding report and the wall time; plus a few lowering behaviours (errors, CPU inputs).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from ember import optim
from ember.core import TrainState, random
from ember.core.jit import jit
from ember.core.mesh import Mesh
from ember.core.partition_specs import PartitionSpec, Sharding, for_mesh, shard, shard_batch, use_sharding
from ember.core.partition_specs.report import describe_sharding, sharding_table
from ember.core.partition_specs.xla import enable_spmd
from ember.core.pytree import tree_leaves_with_path
from ember.core.step_fns import train_step
from ember.models import build_model, lm_loss

LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16)
STEPS, BATCH, SEQ = 10, 8, 16


def setup():
    model = build_model("llama3", "tiny", **LLAMA)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, LLAMA["vocab_size"], (BATCH, SEQ + 1), generator=g)
        batches.append({"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()})
    return model, tx, state, batches


def run_eager(model, tx, state, batches):
    step = jit(train_step(lm_loss(model), tx), backend="eager")
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return losses, state


def run_mesh(text, model, tx, state, batches, ref_state):
    t0 = time.perf_counter()
    mesh = Mesh.parse(text, devices=int(os.environ["CPU_NUM_DEVICES"]), backend="xla")
    sharding = Sharding(mesh, for_mesh(mesh.names))
    low = sharding.lowering
    state = shard(state, sharding, axes=model.axes)
    predicted = {r.path: list(r.local_shape) for r in sharding_table(state, sharding, axes=model.axes)}
    step = jit(train_step(lm_loss(model), tx), backend="xla", donate="state")
    losses, per_step = [], []
    with use_sharding(sharding):
        for b in batches:
            before = step.compile_count
            state, metrics = step(state, shard_batch(b, sharding))
            per_step.append(step.compile_count - before)
            losses.append(metrics["loss"])
    losses = [float(low.gather(x)) for x in losses]
    local = {p: list(low.local_shape(x)) for p, x in tree_leaves_with_path(state.params)}
    opt_local = {"opt_state." + p: list(low.local_shape(x)) for p, x in tree_leaves_with_path(state.opt_state)}
    ref = dict(tree_leaves_with_path(ref_state.params))
    param_diff = max(float((low.gather(x) - ref[p]).abs().max()) for p, x in tree_leaves_with_path(state.params))
    return {"losses": losses, "per_step_compiles": per_step, "local": local, "opt_local": opt_local,
            "predicted": predicted, "param_diff": param_diff, "report": describe_sharding(state, sharding, axes=model.axes),
            "repr": repr(low), "seconds": time.perf_counter() - t0}


def lowering_behaviour(n):
    """Errors and edge cases of XlaLowering, in the already-running SPMD process."""
    out = {}
    wrong = Mesh.parse(f"dp={n * 2}", backend="xla")
    try:
        Sharding(wrong, for_mesh(wrong.names))
    except ValueError as err:
        out["wrong_size"] = [type(err).__name__, str(err)]
    mesh = Mesh.parse(f"dp={n}", devices=n, backend="xla")
    low = Sharding(mesh, for_mesh(mesh.names)).lowering
    cpu = torch.arange(6.0).reshape(2 * n, -1) if 6 % (2 * n) == 0 else torch.arange(4.0 * n).reshape(2 * n, 2)
    out["cpu_constrain_is_identity"] = low.constrain(cpu, PartitionSpec("dp", None)) is cpu
    placed = low.place(cpu, PartitionSpec("dp", None))
    again = low.place(placed, PartitionSpec(None, None))  # an XLA input is copied, not re-sharded in place
    out["place_local"] = [list(low.local_shape(placed)), list(low.local_shape(again))]
    out["place_roundtrip"] = bool(torch.equal(low.gather(placed), cpu)) and bool(torch.equal(low.gather(again), cpu))
    try:
        low.place(cpu, PartitionSpec("dp"))
    except ValueError as err:
        out["bad_rank"] = [type(err).__name__, str(err)]
    return out


def main(meshes):
    enable_spmd()  # before any XLA tensor; afterwards CPU and XLA backward passes may mix
    model, tx, state, batches = setup()
    t0 = time.perf_counter()
    ref_losses, ref_state = run_eager(model, tx, state, batches)
    out = {"eager_losses": ref_losses, "eager_seconds": time.perf_counter() - t0, "meshes": {}}
    for text in meshes:
        out["meshes"][text] = run_mesh(text, model, tx, state, batches, ref_state)
    out["behaviour"] = lowering_behaviour(int(os.environ["CPU_NUM_DEVICES"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
