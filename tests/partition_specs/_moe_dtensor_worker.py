"""Worker for `test_moe_dtensor.py`: a tiny Qwen3-MoE (or DeepSeek-V3) on expert-parallel DTensor meshes over gloo.

    python tests/partition_specs/_moe_dtensor_worker.py --world 4 --meshes "ep=2,fsdp=2;ep=2,tp=2" --out DIR

Spawns `--world` processes (gloo over a FileStore in DIR). On every mesh and for each capacity
(dropless with a sigmoid router and its expert bias, and one that drops), each rank builds the same
state and batches (`setup`), shards them with the launcher's layout (`for_mesh`, mesh in
`MESH_ORDER`), takes the gradients of the first
batch and then runs `STEPS` train steps inside `use_sharding`. It records the losses, the
`moe_dropped` metric, the local shard shapes, and the calls of DTensor's Shard(i) -> Shard(j)
all-to-all (`shard_dim_alltoall`; gloo runs it as all-gather + chunk) during one step. Rank 0
writes `DIR/results.json` and the gathered gradients and final params to `DIR/<mesh>_<capacity>.pt`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _processes
from _processes import end_gloo_rank  # noqa: E402

MOE = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, attn_head_dim=8, n_layers=2, ffn_dim=64,
           max_seq_len=16, n_experts=6, experts_per_token=2, moe_ffn_dim=16, router_aux_loss_coef=0.01,
           router_z_loss_coef=0.001)
BATCH, SEQ, STEPS = 8, 16, 3
CAPACITIES = {"dropless": None, "drops": 0.5}
FAMILIES = {  # family -> what it changes in MOE
    "qwen3_moe": {},
    # latent attention (a key and value per head; the queries' bottleneck on), a dense first layer, 2 groups
    "deepseek_v3": dict(n_kv_heads=4, attn_head_dim=None, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6, first_dense_layers=1, n_expert_groups=2, topk_groups=1),
}


def setup(capacity_factor, family="qwen3_moe"):
    """(model, tx, state, batches, loss_fn): the same on every process and in the single-device reference."""
    from ember import optim
    from ember.core import TrainState, random
    from ember.models import build_model, lm_loss

    # dropless with DeepSeek-V3's sigmoid router and its expert bias (moved by the summed loads, so exact on a
    # mesh); the capacity that drops with softmax routing
    routing = dict(router="sigmoid", expert_bias=True, expert_bias_update_rate=0.01) if capacity_factor is None else {}
    model = build_model(family, "tiny", **{**MOE, **FAMILIES[family]}, **routing, capacity_factor=capacity_factor)
    # eps 1e-6: Adam divides by |g|, and an element whose gradient is ~0 would turn float noise of the
    # sharded sums (1e-9) into a whole learning-rate step (one element of 3072 moved by 2.6e-5 at 1e-8)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-3, eps=1e-6, weight_decay=0.1))
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))
    tokens = random.randint(random.key(2), (STEPS, BATCH, SEQ + 1), 0, MOE["vocab_size"])
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    return model, tx, state, batches, lm_loss(model)


def grads_of(loss_fn, params, batch):
    """Gradients of the first batch's mean loss (router losses included)."""
    from ember.core.transforms import grad

    def mean_loss(p):
        loss, _ = loss_fn(p, batch, key=None)
        return loss.mean()

    return grad(mean_loss)(params)


def run(step_fn, state, batches):
    """(losses, dropped fractions, final state) over `batches`."""
    losses, dropped = [], []
    for batch in batches:
        state, metrics = step_fn(state, batch)
        losses.append(metrics["loss"])
        dropped.append(metrics["moe_dropped"])
    return losses, dropped, state


def _alltoall_calls():
    """Wrap DTensor's shard_dim_alltoall (test-only, private) to record `(mesh_dim, gather_dim, shard_dim)`."""
    from torch.distributed.tensor import placement_types

    calls = []
    original = placement_types.shard_dim_alltoall

    def recording(input, gather_dim, shard_dim, mesh, mesh_dim):
        calls.append([mesh.mesh_dim_names[mesh_dim], gather_dim, shard_dim, list(input.shape)])
        return original(input, gather_dim, shard_dim, mesh, mesh_dim)

    placement_types.shard_dim_alltoall = recording
    return calls


def _grouped_calls():
    """Count the grouped matmuls of the dropless experts (test-only wrapper)."""
    from ember.models.layers import moe_grouped

    calls = []
    original = moe_grouped.grouped_mm

    def counting(*args):
        calls.append(1)
        return original(*args)

    moe_grouped.grouped_mm = counting
    return calls


def _run_mesh(text: str, world: int, capacity, out: str, calls: list, grouped: list, family: str) -> dict:
    import torch.distributed as dist

    from ember.core.mesh import Mesh
    from ember.core.partition_specs import MESH_ORDER, Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step

    model, tx, state, batches, loss_fn = setup(capacity, family)
    mesh = Mesh.parse(text, devices=world, backend="dtensor").in_order(MESH_ORDER)
    sharding = Sharding(mesh, for_mesh(mesh.names))
    low = sharding.lowering
    state = shard(state, sharding, axes=model.axes)
    step = train_step(loss_fn, tx)
    with use_sharding(sharding):
        batches = [shard_batch(b, sharding) for b in batches]
        grads = grads_of(loss_fn, state.params, batches[0])
        del calls[:], grouped[:]
        losses, dropped, state = run(step, state, batches)
        step_calls = list(calls[: len(calls) // STEPS])
        grouped_per_step = len(grouped) // STEPS
    params = {p[len("params."):]: x for p, x in tree_leaves_with_path(state) if p.startswith("params.")}
    full = {"grads": {p: low.gather(g) for p, g in tree_leaves_with_path(grads)},
            "params": {p: low.gather(x) for p, x in params.items()}}  # collectives: every rank
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(out, f"{text}_{capacity}.pt".replace("=", "").replace(",", "_")))
    return {
        "losses": [float(low.gather(x)) for x in losses],
        "dropped": [float(low.gather(x)) for x in dropped],
        "local": {p: list(low.local_shape(x)) for p, x in params.items()},
        "alltoall_per_step": step_calls,
        "grouped_per_step": grouped_per_step,
    }


def _worker(rank: int, world: int, out: str, meshes: list, capacities: list, family: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), world), rank=rank,
                            world_size=world)
    calls, grouped = _alltoall_calls(), _grouped_calls()
    results = {}
    for text in meshes:
        for name in capacities:
            capacity = CAPACITIES[name]
            start = time.perf_counter()
            try:
                results[f"{text}/{name}"] = _run_mesh(text, world, capacity, out, calls, grouped, family)
            except Exception:  # report every mesh, not only the first failure
                results[f"{text}/{name}"] = {"error": traceback.format_exc()[-4000:]}
            results[f"{text}/{name}"]["wall_s"] = time.perf_counter() - start
    if rank == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    end_gloo_rank()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--meshes", required=True, help="';'-separated meshes, each using all --world ranks")
    p.add_argument("--out", required=True)
    p.add_argument("--capacities", default=",".join(CAPACITIES), help="','-separated names of CAPACITIES")
    p.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILIES))
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    os.makedirs(args.out, exist_ok=True)
    meshes = [m for m in args.meshes.split(";") if m]
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
    mp.start_processes(_worker, args=(args.world, args.out, meshes, args.capacities.split(","), args.family),
                       nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
