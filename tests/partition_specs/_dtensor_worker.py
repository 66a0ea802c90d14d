"""Worker for `test_dtensor_matrix.py`: train a tiny Llama on several DTensor meshes over gloo.

    python tests/partition_specs/_dtensor_worker.py --world 4 --meshes "fsdp=4;fsdp=2,tp=2" --out DIR

Spawns `--world` processes (gloo over a FileStore in DIR). On every mesh each rank builds the same
state and batches (`setup`), shards them with `Sharding(mesh, for_mesh(mesh.names))`, runs
`--steps` steps inside `use_sharding` and records the loss trajectory, the local shard shape of
every parameter and of its Adam `mu`, whether every state leaf kept its placements, the gathered
final parameters, and (eager runs) the collectives of one block's forward and backward
(`block_collectives`, also used by `_dtensor_comm.py`) and the loss and gradients under masked
attention: packed documents, a sliding window (`masked_grads`). Rank 0 writes `DIR/results.json` and
`DIR/<mesh>.pt`; an exception on a mesh is recorded as that mesh's `error` and the next mesh
still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _processes
from _processes import end_gloo_rank  # noqa: E402

LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16)
BATCH, SEQ, STEPS = 8, 16, 10


def setup(steps: int = STEPS):
    """(model, tx, state, batches): the same on every process and in the single-device reference."""
    from ember import optim
    from ember.core import TrainState, random
    from ember.models import build_model

    model = build_model("llama3", "tiny", **LLAMA)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-3, weight_decay=0.1))
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))
    tokens = random.randint(random.key(2), (steps, BATCH, SEQ + 1), 0, LLAMA["vocab_size"])
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    return model, tx, state, batches


def comm_mode():
    """A `CommDebugMode` that also records each collective's local input size (elements)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    class SizedCommDebugMode(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.sized: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._overloadpacket.__name__
            if not any(t == DTensor for t in types) and args and isinstance(args[0], torch.Tensor) and any(
                    c in name for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")):
                key = (name.replace("_into_tensor", "").replace("_tensor", ""), args[0].numel())
                self.sized[key] = self.sized.get(key, 0) + 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    return SizedCommDebugMode()


def comm_counts(mode) -> dict:
    """`{"all_reduce x 512": 2, ...}`: collectives by kind and local input size."""
    totals = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}
    assert sum(totals.values()) == sum(mode.sized.values()), (totals, mode.sized)
    return {f"{op} x {numel}": n for (op, numel), n in sorted(mode.sized.items())}


def block_collectives(model, params, sharding) -> dict:
    """`{"forward": counts, "backward": counts}` for block 0 of `model` (params: the full model's, unsharded)."""
    from ember.core.partition_specs import shard, use_sharding
    from ember.models.layers.axes import RESIDUAL_AXES

    stack = model.children["blocks"]  # the blocks stacked: block 0 is the first slice of each leaf
    block, block_params = stack.layer, shard(stack.unstack(params["blocks"])[0], sharding, axes=stack.layer.axes)
    x = torch.randn(BATCH, SEQ, LLAMA["d_model"], generator=torch.Generator().manual_seed(0))
    x = sharding.lowering.place(x, sharding.compute_spec(RESIDUAL_AXES))
    positions = torch.arange(SEQ)
    with use_sharding(sharding):
        fn = lambda p: block.apply(p, x, positions=positions)  # noqa: E731
        torch.func.vjp(fn, block_params)[1](torch.ones_like(fn(block_params)))  # warm-up: caches, lazy groups
        with comm_mode() as fwd:
            y, vjp_fn = torch.func.vjp(fn, block_params)
        with comm_mode() as bwd:
            vjp_fn(torch.ones_like(y))
    return {"forward": comm_counts(fwd), "backward": comm_counts(bwd)}


def _func_value_and_grad(fn):
    """`(value, grads)` by torch.func's own transform, inside which the DTensors are hidden from `isinstance`."""
    def run(*args):
        grads, value = torch.func.grad_and_value(fn)(*args)
        return value, grads
    return run


def masked_grads(params, batch, sharding) -> Any:
    """Max |difference| from one device of the loss and of every gradient under a masked attention, or the
    error: a batch packing two documents a row (`segment_ids`: a mask laid out as the batch), and a sliding
    window (a mask of one row for the whole batch). On DTensor the fused kernel runs on each process's shard;
    under a user's `torch.func.grad`, explicitly (an error where the heads are split)."""
    from ember.core import value_and_grad
    from ember.core.partition_specs import shard, shard_batch, use_sharding
    from ember.core.pytree import tree_leaves
    from ember.models import build_model, lm_loss

    segment_ids = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ)  # two packed documents per row
    llama, packed = build_model("llama3", "tiny", **LLAMA), {**batch, "segment_ids": segment_ids}
    cases = {"packed": (llama, packed, value_and_grad),
             "window": (build_model("llama3", "tiny", **LLAMA, sliding_window=SEQ // 4), batch, value_and_grad),
             "packed, torch.func.grad": (llama, packed, _func_value_and_grad)}
    out = {}
    for name, (model, inputs, transform) in cases.items():
        loss_fn = lm_loss(model)
        grad_fn = transform(lambda p, b, loss_fn=loss_fn: loss_fn(p, b, key=None).mean())
        want_loss, want = grad_fn(params, inputs)
        try:
            with use_sharding(sharding):
                loss, grads = grad_fn(shard(params, sharding, axes=model.axes), shard_batch(inputs, sharding))
        except NotImplementedError as err:
            out[name] = str(err)
            continue
        low = sharding.lowering
        diffs = [(low.gather(g) - w).abs().max() for g, w in zip(tree_leaves(grads), tree_leaves(want))]
        out[name] = {"loss": float((low.gather(loss) - want_loss).abs()), "grads": float(max(diffs))}
    return out


def mesh_file(text: str) -> str:
    """A file name for a mesh's gathered parameters (`fsdp=2,tp=2` -> `fsdp2_tp2.pt`)."""
    return text.replace("=", "").replace(",", "_") + ".pt"


def _run_mesh(text: str, world: int, steps: int, compiled: bool, out: str) -> dict:
    import torch.distributed as dist

    from ember.core.jit import jit
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step
    from ember.models import lm_loss

    model, tx, state, batches = setup(steps)
    mesh = Mesh.parse(text, devices=world, backend="dtensor")
    sharding = Sharding(mesh, for_mesh(mesh.names))
    low = sharding.lowering
    comm = None if compiled else block_collectives(model, state.params, sharding)
    masked = None if compiled else masked_grads(state.params, batches[0], sharding)
    state = shard(state, sharding, axes=model.axes)
    before = {p: tuple(x.placements) for p, x in tree_leaves_with_path(state)}
    step = train_step(lm_loss(model), tx)
    if compiled:
        step = jit(step, backend="inductor")
    losses, seconds = [], []
    with use_sharding(sharding):
        for batch in batches:
            start = time.perf_counter()
            state, metrics = step(state, shard_batch(batch, sharding))
            losses.append(float(low.gather(metrics["loss"])))  # host sync
            seconds.append(time.perf_counter() - start)
        batch_local = low.local_shape(shard_batch(batches[0], sharding)["inputs"])
    leaves = dict(tree_leaves_with_path(state))
    moved = sorted(p for p, x in leaves.items() if tuple(x.placements) != before[p])
    mu_prefix = next(p for p in leaves if ".mu." in p).split(".mu.")[0] + ".mu."
    params = {p[len("params."):]: x for p, x in leaves.items() if p.startswith("params.")}
    full = {p: low.gather(x) for p, x in params.items()}  # collective: every rank
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(out, mesh_file(text)))
    return {
        "losses": losses,
        "seconds": seconds,
        "local": {p: list(low.local_shape(x)) for p, x in params.items()},
        "mu_local": {p: list(low.local_shape(leaves[mu_prefix + p])) for p in params},
        "placements_moved": moved,
        "batch_local": list(batch_local),
        "compile_count": getattr(step, "compile_count", 0),
        "block_collectives": comm,
        "masked_grads": masked,
    }


def _worker(rank: int, world: int, out: str, meshes: list, steps: int, compiled: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = {}
    for text in meshes:
        start = time.perf_counter()
        try:
            results[text] = _run_mesh(text, world, steps, compiled, out)
        except Exception:  # report every mesh, not only the first failure
            results[text] = {"error": traceback.format_exc()[-4000:]}
        results[text]["wall_s"] = time.perf_counter() - start
    if rank == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    end_gloo_rank()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--meshes", required=True, help="';'-separated meshes, each using all --world ranks")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--compile", action="store_true", help="jit(step, backend='inductor')")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    os.makedirs(args.out, exist_ok=True)
    meshes = [m for m in args.meshes.split(";") if m]
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
    mp.spawn(_worker, args=(args.world, args.out, meshes, args.steps, args.compile), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
