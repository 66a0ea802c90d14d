"""Worker for `test_context_parallel_dtensor.py`: a tiny Llama trained with its sequence split over `cp` (gloo).

    python tests/partition_specs/_context_dtensor_worker.py --world 2 --out DIR

Spawns `--world` processes. For each case of `CASES[world]` every rank builds `setup()`'s state and
batches, puts each sequence in `cp`'s head-tail order (`ember.data.ContextOrder`), shards them with the
ready-made layout of the case's mesh, takes the first batch's gradients (counting the collectives of one
forward and backward) and runs `STEPS` SGD steps inside `use_sharding`. Each rank writes
`DIR/results_<rank>.json`: losses, gradients and final parameters (gathered whole) and the collectives.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dtensor_worker import comm_counts, comm_mode  # noqa: E402
from _gloo_runs import serve  # noqa: E402
from _moe_dtensor_worker import grads_of  # noqa: E402  (the first batch's mean-loss gradients)

LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16,
             tie_embeddings=True)
BATCH, SEQ, STEPS, LR = 4, 16, 3, 0.5
# Eagerly: a compiled case is a cold compile in each process (the 4-process world took 465 s on 2 cores with
# cp=2,fsdp=2 compiled; CI ran past its time). tests/launch/test_torchrun_pp_cp.py compiles cp=2 under torchrun.
CASES = {  # name: (mesh, packed documents)
    2: {"cp=2": ("cp=2", False), "cp=2 packed": ("cp=2", True)},
    4: {"cp=2,fsdp=2": ("fsdp=2,cp=2", True), "cp=2,tp=2": ("cp=2,tp=2", True)},
}


def setup(packed: bool):
    """(model, tx, state, batches, loss_fn) in the natural order: the one-device reference's."""
    from ember import optim
    from ember.core import TrainState, random
    from ember.models import build_model, lm_loss

    model = build_model("llama3", "tiny", **LLAMA)
    tx = optim.sgd(LR)
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))
    tokens = random.randint(random.key(2), (STEPS, BATCH, SEQ + 1), 0, LLAMA["vocab_size"])
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    if packed:  # SFT packing: three documents a row, positions restarting, padding (segment 0) at the end
        segment_ids = torch.tensor([1] * 5 + [2] * 6 + [3] * 3 + [0] * 2).expand(BATCH, SEQ)
        positions = torch.tensor([*range(5), *range(6), *range(3), 0, 0]).expand(BATCH, SEQ)
        for b in batches:
            b.update(segment_ids=segment_ids.clone(), positions=positions.clone())
            b["targets"] = torch.where(segment_ids > 0, b["targets"], -100)
    return model, tx, state, batches, lm_loss(model)


def in_context_order(batch: dict, cp: int) -> dict:
    from ember.data import ContextOrder

    out = ContextOrder(cp)({k: v.numpy() for k, v in batch.items()})
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def _run(mesh_text: str, world: int, packed: bool) -> dict:
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step

    model, tx, state, batches, loss_fn = setup(packed)
    mesh = Mesh.parse(mesh_text, devices=world, backend="dtensor")
    sharding = Sharding(mesh, for_mesh(mesh.names))
    low = sharding.lowering
    batches = [in_context_order(b, mesh.sizes()["cp"]) for b in batches]
    start = shard(state, sharding, axes=model.axes)
    state = shard(state, sharding, axes=model.axes)
    step = train_step(loss_fn, tx)
    with use_sharding(sharding):
        losses = []
        for batch in batches:
            state, metrics = step(state, shard_batch(batch, sharding))
            losses.append(float(low.gather(metrics["loss"])))
        with comm_mode() as mode:
            grads = grads_of(loss_fn, start.params, shard_batch(batches[0], sharding))
    return {"losses": losses, "collectives": comm_counts(mode),
            "grads": {p: low.gather(g).tolist() for p, g in tree_leaves_with_path(grads)},
            "params": {p: low.gather(x).tolist() for p, x in tree_leaves_with_path(state.params)}}


if __name__ == "__main__":
    serve(CASES, _run, __doc__)
