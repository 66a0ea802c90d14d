"""Worker for `test_muon_dtensor.py`: Muon + AdamW groups on DTensor meshes over gloo, against one device.

    python tests/partition_specs/_muon_dtensor_worker.py --world 2 --meshes "fsdp=2;tp=2;ep=2" --out DIR

Spawns `--world` processes (gloo over a FileStore in DIR). For every mesh and both Newton-Schulz placements
(`owner`, `gather`), each rank builds the same state and batches, runs `STEPS` train steps of
`muon(param_axes=model.axes)` (labels by `muon_labels`) after a global-norm clip on one device and on the mesh, and
records the largest parameter difference, the collectives of one optimizer update (`tx.update` alone, by kind
and local input size) and the local shapes of every matrix's momentum against its parameter's. A mesh with
`ep` trains a tiny Qwen3-MoE (expert stacks orthogonalised per expert), the others a tiny Llama. With
`--compile` the mesh's step is `jit(step, backend="inductor")`. Rank 0
writes `DIR/results.json`; an exception is recorded as that run's `error`.

    python tests/partition_specs/_muon_dtensor_worker.py --table   # the BENCHMARKS.md table (about 40 s)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dtensor_worker as W  # noqa: E402
from _processes import end_gloo_rank  # noqa: E402  (tests/ is on the path through _dtensor_worker)

STEPS = 3
PLACEMENTS = ("owner", "gather")
MOE = dict(W.LLAMA, n_experts=4, experts_per_token=2, moe_ffn_dim=16)
TABLE_MESHES = {2: ["fsdp=2", "tp=2", "ep=2"], 4: ["fsdp=2,tp=2"]}


def setup(mesh_text: str, placement: str):
    """(model, tx, state, batches): the same on every process and in the one-device reference."""
    from ember import optim
    from ember.core import TrainState, random
    from ember.models import build_model

    model = build_model("qwen3_moe", "tiny", **MOE) if "ep" in mesh_text else build_model("llama3", "tiny", **W.LLAMA)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.muon(
        1e-2, weight_decay=0.1, adam_weight_decay=0.1, adam_learning_rate=3e-3, consistent_rms=0.2,
        ns_placement=placement, param_axes=model.axes))
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))
    tokens = random.randint(random.key(2), (STEPS, W.BATCH, W.SEQ + 1), 0, W.LLAMA["vocab_size"])
    return model, tx, state, [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def _run(mesh_text: str, placement: str, world: int, compiled: bool) -> dict:
    from ember.core.jit import jit
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step
    from ember.models import lm_loss

    model, tx, state, batches = setup(mesh_text, placement)
    step = train_step(lm_loss(model), tx)
    ref = state
    for batch in batches:
        ref, _ = step(ref, batch)
    mesh = Mesh.parse(mesh_text, devices=world, backend="dtensor")
    sharding = Sharding(mesh, for_mesh(mesh.names))
    low = sharding.lowering
    state = shard(state, sharding, axes=model.axes)
    sharded_step = jit(step, backend="inductor") if compiled else step
    with use_sharding(sharding):
        for batch in batches:
            state, _ = sharded_step(state, shard_batch(batch, sharding))
        grads = state.params  # any tree laid out as the params: the update's collectives do not depend on values
        with W.comm_mode() as mode:
            tx.update(grads, state.opt_state, state.params)
    leaves = dict(tree_leaves_with_path(state))
    mu = {p.split(".mu.")[1]: x for p, x in leaves.items() if ".muon." in p and ".mu." in p}
    diff = max(float((low.gather(x) - y).abs().max())
               for (_, x), (_, y) in zip(tree_leaves_with_path(state.params), tree_leaves_with_path(ref.params)))
    return {"max_param_diff": diff, "compile_count": getattr(sharded_step, "compile_count", 0), "update_collectives": W.comm_counts(mode),
            "muon_leaves": sorted(mu),
            "mu_local_matches_param": all(low.local_shape(x) == low.local_shape(leaves["params." + p])
                                          for p, x in mu.items())}


def _worker(rank: int, world: int, out: str, meshes: list, placements: tuple, compiled: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), world), rank=rank,
                            world_size=world)
    results = {}
    for text in meshes:
        for placement in placements:
            try:
                results[f"{text} {placement}"] = _run(text, placement, world, compiled)
            except Exception:  # report every run, not only the first failure
                results[f"{text} {placement}"] = {"error": traceback.format_exc()[-4000:]}
    if rank == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    end_gloo_rank()


def _spawn(world: int, out: str, meshes: list, placements: tuple = PLACEMENTS, compiled: bool = False) -> None:
    import torch.multiprocessing as mp

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
    mp.spawn(_worker, args=(world, out, meshes, placements, compiled), nprocs=world)


def _table() -> None:
    print("| mesh | placement | one optimizer update's collectives (count x kind x local elements) |")
    print("|---|---|---|")
    for world, meshes in TABLE_MESHES.items():
        with tempfile.TemporaryDirectory() as out:
            _spawn(world, out, meshes)
            with open(os.path.join(out, "results.json")) as f:
                for run, r in json.load(f).items():
                    counts = r.get("update_collectives") or {}
                    print(f"| {' | '.join(run.split(' '))} | "
                          f"{', '.join(f'{n} x {op}' for op, n in counts.items()) or r.get('error', 'none')} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int)
    p.add_argument("--meshes", help="';'-separated meshes, each using all --world ranks")
    p.add_argument("--out")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="','-separated Newton-Schulz placements")
    p.add_argument("--compile", action="store_true", help="jit(step, backend='inductor') on the mesh")
    p.add_argument("--table", action="store_true", help="print the collectives table for BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.table:
        return _table()
    os.makedirs(args.out, exist_ok=True)
    _spawn(args.world, args.out, [m for m in args.meshes.split(";") if m], tuple(args.placements.split(",")),
           args.compile)


if __name__ == "__main__":
    sys.exit(main())
