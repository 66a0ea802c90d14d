"""Token-weighted steps on a dp=2 mesh whose ranks hold different valid-token counts.

    python tests/step_fns/_token_weighting_mesh.py dtensor OUT_DIR   # 2 gloo processes, writes OUT_DIR/results.json
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python tests/step_fns/_token_weighting_mesh.py xla OUT_DIR

`make_case` puts rows 0-3 (rank 0's shard) mostly valid and rows 4-7 (rank 1's) mostly ignored.
For every seed and `microbatches` in (1, 2) the sharded step (eager and compiled) runs once and its
loss, token count and gradients (SGD, lr=1) are written beside the single-device reference's.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _token_weighting import SEEDS, loss_fn, make_case  # noqa: E402

AXES = {"w1": ("embed", "mlp"), "w2": ("mlp", "vocab")}
MICROBATCHES = (1, 2)


def one_step(params, batch, microbatches, *, backend, sharding=None):
    """`(loss, tokens, grads)` of one SGD(lr=1) step, gathered to full CPU tensors."""
    from ember import optim
    from ember.core import TrainState, random
    from ember.core.jit import jit
    from ember.core.partition_specs import shard, shard_batch, use_sharding
    from ember.core.step_fns import train_step

    state = TrainState.create(params=params, tx=optim.sgd(1.0), key=random.key(9))
    step = train_step(loss_fn, microbatches=microbatches)
    step = jit(step, backend=backend) if backend != "eager" else step
    if sharding is None:
        new, metrics = step(state, batch)
        gather = lambda x: x  # noqa: E731
    else:
        gather = sharding.lowering.gather
        with use_sharding(sharding):
            new, metrics = step(shard(state, sharding, axes=AXES), shard_batch(batch, sharding))
    grads = {k: (params[k] - gather(new.params[k]).cpu()).tolist() for k in params}
    return {"loss": float(gather(metrics["loss"])), "tokens": float(gather(metrics["tokens"])), "grads": grads}


def run_all(backends, sharding, *, reference_backend="eager"):
    results = {}
    for seed in SEEDS:
        params, batch = make_case(seed)
        results[f"{seed}/reference"] = one_step(params, batch, 1, backend=reference_backend)
        for backend in backends:
            for m in MICROBATCHES:
                results[f"{seed}/{backend}/{m}"] = one_step(params, batch, m, backend=backend, sharding=sharding)
    return results


def _dtensor_worker(rank: int, out: str) -> None:
    import torch.distributed as dist

    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), 2), rank=rank, world_size=2)
    try:
        mesh = Mesh.parse("dp=2", devices=2, backend="dtensor")
        results = run_all(("eager", "inductor"), Sharding(mesh, for_mesh(mesh.names)))
        if rank == 0:
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _xla(out: str) -> None:
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh

    mesh = Mesh.parse("dp=2", devices=2, backend="xla")
    results = run_all(("xla",), Sharding(mesh, for_mesh(mesh.names)))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    kind, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    if kind == "dtensor":
        import torch.multiprocessing as mp

        mp.spawn(_dtensor_worker, args=(out_dir,), nprocs=2)
    else:
        _xla(out_dir)
