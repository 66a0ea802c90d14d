"""Worker for `test_dpo_meshes.py`: DPO steps with a frozen reference on meshes, against one device.

    python tests/partition_specs/_dpo_mesh_worker.py dtensor --world 2 --meshes "dp=2;fsdp=2" --out DIR [--compile]
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python tests/partition_specs/_dpo_mesh_worker.py xla --meshes "dp=2;fsdp=2"

Each run builds the same tiny Llama, a reference equal to its initial weights (`TrainStateWithFrozen`) and
`STEPS` batches of pairs, runs `train_step(dpo_loss(model), adamw)` on one device and on the mesh (DTensor
over gloo, `--world` processes; or torch_xla SPMD on virtual CPU devices, compiled with `jit(backend="xla")`),
and records the largest parameter and loss differences, the compiles, and whether every reference leaf is
laid out like its parameter. DTensor: rank 0 writes `DIR/results.json`; XLA: one JSON line on stdout.
An exception is recorded as that run's `error`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dtensor_worker as W  # noqa: E402
from _processes import end_gloo_rank  # noqa: E402

STEPS = 3
PROMPT = 5  # the first target positions of every row are the prompt's (ignored)


def pairs(key, n: int):
    """`n` batches of `W.BATCH` pairs of `W.SEQ` tokens; rejected responses end 3 tokens early (padding)."""
    from ember.core import random

    tokens = random.randint(key, (n, 2, W.BATCH, W.SEQ + 1), 0, W.LLAMA["vocab_size"])
    out = []
    for t in tokens:
        batch = {}
        for side, ids, end in (("chosen", t[0], W.SEQ), ("rejected", t[1], W.SEQ - 3)):
            targets = ids[:, 1:].clone()
            targets[:, :PROMPT] = -100
            targets[:, end:] = -100
            batch[f"{side}_inputs"], batch[f"{side}_targets"] = ids[:, :-1], targets
        batch["rejected_inputs"][:, :PROMPT] = batch["chosen_inputs"][:, :PROMPT]  # one prompt per pair
        out.append(batch)
    return out


def setup():
    from ember import optim
    from ember.core import TrainStateWithFrozen, pytree, random
    from ember.core.step_fns import train_step
    from ember.models import build_model, dpo_loss

    model = build_model("llama3", "tiny", **W.LLAMA)
    params = model.init(random.key(0))
    state = TrainStateWithFrozen.create(params=params, tx=optim.adamw(1e-2), key=random.key(1),
                                        frozen=pytree.tree_map(torch.clone, params))
    return model, state, train_step(dpo_loss(model, beta=0.5)), pairs(random.key(2), STEPS)


def _compare(state, ref, losses, ref_losses, low) -> dict:
    from ember.core.pytree import tree_leaves_with_path

    diff = max(float((low.gather(x) - y).abs().max())
               for (_, x), (_, y) in zip(tree_leaves_with_path(state.params), tree_leaves_with_path(ref.params)))
    laid_out = all(low.local_shape(f) == low.local_shape(p) for (_, f), (_, p) in
                   zip(tree_leaves_with_path(state.frozen), tree_leaves_with_path(state.params)))
    split = any(low.local_shape(f) != tuple(f.shape) for _, f in tree_leaves_with_path(state.frozen))
    return {"max_param_diff": diff, "frozen_split": split, "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "frozen_like_params": laid_out, "frozen_unchanged": max(
                float((low.gather(f) - g).abs().max()) for (_, f), (_, g) in
                zip(tree_leaves_with_path(state.frozen), tree_leaves_with_path(ref.frozen))) == 0.0}


def run(mesh_text: str, devices: int, backend: str, compiled: bool) -> dict:
    from ember.core.jit import jit
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import MESH_ORDER, Sharding, for_mesh, shard, shard_batch, use_sharding

    model, state, step, batches = setup()
    ref, ref_losses = state, []
    for batch in batches:
        ref, metrics = step(ref, batch)
        ref_losses.append(float(metrics["loss"]))
    mesh = Mesh.parse(mesh_text, devices=devices, backend=backend).in_order(MESH_ORDER)
    sharding = Sharding(mesh, for_mesh(mesh.names))
    state = shard(state, sharding, axes=model.axes)
    sharded_step = jit(step, backend=backend if backend == "xla" else "inductor") if compiled else step
    losses = []
    with use_sharding(sharding):
        for batch in batches:
            state, metrics = sharded_step(state, shard_batch(batch, sharding))
            losses.append(float(sharding.lowering.gather(metrics["loss"])))
    out = _compare(state, ref, losses, ref_losses, sharding.lowering)
    out["compile_count"] = getattr(sharded_step, "compile_count", 0)
    return out


def _worker(rank: int, world: int, out: str, meshes: list, compiled: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), world), rank=rank,
                            world_size=world)
    results = {}
    for text in meshes:
        try:
            results[text] = run(text, world, "dtensor", compiled)
        except Exception:  # report every mesh, not only the first failure
            results[text] = {"error": traceback.format_exc()[-4000:]}
    if rank == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    end_gloo_rank()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("mode", choices=["dtensor", "xla"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--meshes", help="';'-separated meshes, each using every device")
    p.add_argument("--out")
    p.add_argument("--compile", action="store_true", help="DTensor: jit(step, backend='inductor') on the mesh")
    args = p.parse_args(argv)
    meshes = [m for m in args.meshes.split(";") if m]
    if args.mode == "xla":
        from ember.core.partition_specs.xla import enable_spmd

        enable_spmd()  # before any XLA tensor
        print(json.dumps({m: run(m, int(os.environ["CPU_NUM_DEVICES"]), "xla", True) for m in meshes}))
        return
    import torch.multiprocessing as mp

    os.makedirs(args.out, exist_ok=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
    mp.spawn(_worker, args=(args.world, args.out, meshes, args.compile), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
