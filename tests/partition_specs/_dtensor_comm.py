"""Count the collectives DTensor issues for one Llama block, forward and backward, per layout.

    python tests/partition_specs/_dtensor_comm.py            # prints a markdown table (about 40 s)

Runs 2 gloo ranks for dp=2 and tp=2, then 4 for fsdp=4, dp=2,tp=2 and fsdp=2,tp=2. For each
mesh: one block of the tiny Llama of `_dtensor_worker.py`, its parameters sharded by the layout's
params rules and the input by the residual rules, `torch.func.vjp` of `block.apply` inside
`use_sharding` under `CommDebugMode` (forward = the vjp call, backward = the vjp function), and
then, for context, one whole `train_step` of the 2-block model (embedding, loss, clip + AdamW).
Each entry reads `count x collective x local input elements`: with B=8, T=16, d=32 an activation
all-reduce under tp=2 moves 8*16*32 = 4096 elements, a d-sized norm weight gradient 32.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dtensor_worker as W  # noqa: E402
from _processes import end_gloo_rank  # noqa: E402  (tests/ is on the path through _dtensor_worker)

MESHES = {2: ["dp=2", "tp=2"], 4: ["fsdp=4", "dp=2,tp=2", "fsdp=2,tp=2"]}


def _measure(text: str, world: int) -> dict:
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.step_fns import train_step
    from ember.models import lm_loss

    model, tx, state, batches = W.setup(1)
    mesh = Mesh.parse(text, devices=world, backend="dtensor")
    sharding = Sharding(mesh, for_mesh(mesh.names))
    block = W.block_collectives(model, state.params, sharding)
    out = {"block_forward": block["forward"], "block_backward": block["backward"]}
    with use_sharding(sharding):
        step = train_step(lm_loss(model), tx)
        sharded_state = shard(state, sharding, axes=model.axes)
        batch = shard_batch(batches[0], sharding)
        step(sharded_state, batch)  # warm-up
        with W.comm_mode() as whole:
            step(sharded_state, batch)
        out["train_step"] = W.comm_counts(whole)
    return out


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), world), rank=rank,
                            world_size=world)
    results = {text: _measure(text, world) for text in MESHES[world]}
    if rank == 0:
        with open(os.path.join(out, "comm.json"), "w") as f:
            json.dump(results, f)
    end_gloo_rank()


def _fmt(counts: dict) -> str:
    return ", ".join(f"{n}x {op}" for op, n in counts.items()) or "none"


def main() -> None:
    import torch.multiprocessing as mp

    results = {}
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
    for world in MESHES:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_worker, args=(world, out), nprocs=world)
            with open(os.path.join(out, "comm.json")) as f:
                results.update(json.load(f))
    print("| mesh | block forward | block backward | whole train step (2 blocks + embed + loss + AdamW) |")
    print("|---|---|---|---|")
    for text, r in results.items():
        print(f"| {text} | {_fmt(r['block_forward'])} | {_fmt(r['block_backward'])} | {_fmt(r['train_step'])} |")


if __name__ == "__main__":
    main()
