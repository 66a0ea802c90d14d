"""Worker for `test_pipeline_dtensor.py`: a tiny stacked Llama trained over a mesh with `pp=2` (gloo).

    python tests/partition_specs/_pipeline_dtensor_worker.py --world 2 --out DIR

`--world` processes; for each case of `CASES[world]` every rank builds `setup()`'s state and batches, shards them
with `Sharding(mesh, for_mesh(...), pipeline=PipelineSchedule(microbatches, repeats))`, takes the first batch's
gradients and runs `STEPS` SGD steps inside `use_sharding`. Each rank writes `DIR/results_<rank>.json`:
losses, gradients and final parameters (its copies, gathered whole), and each parameter's local shape.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _context_dtensor_worker import in_context_order  # noqa: E402
from _gloo_runs import serve  # noqa: E402
from _moe_dtensor_worker import grads_of  # noqa: E402  (the first batch's mean-loss gradients)

LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=4, ffn_dim=64, max_seq_len=16,
             scan_layers=True)
MOE = dict(LLAMA, attn_head_dim=8, n_experts=4, experts_per_token=2, moe_ffn_dim=16, first_dense_layers=2,
           router_aux_loss_coef=0.1, router_z_loss_coef=0.01)  # losses large enough that a mis-summed statistic shows
"""Qwen3-MoE, a mixed stack: two dense blocks, then two of 4 experts (one run each, pipelined in turn)."""
MODELS = {"llama": ("llama3", LLAMA), "moe": ("qwen3_moe", MOE)}
"""name: (family, config); every batch row packs two documents."""
BATCH, SEQ, STEPS, LR = 8, 16, 3, 0.5
CASES = {  # name: (mesh, microbatches, compiled, model, repeats)
    # Compiled only where nothing else compiles it: the mixed stack whose stages hold all-to-alls over ep. Every
    # compiled case is a cold compile per process (on 2 cores the 4-process world took 955 s with four compiled
    # cases; CI ran past its time); tests/launch/test_torchrun_pp_cp.py compiles pp=2 (2 repeats) under torchrun.
    2: {"eager": ("pp=2", 4, False, "llama", 1), "eager, 2 microbatches": ("pp=2", 2, False, "llama", 1),
        "eager, 2 repeats": ("pp=2", 4, False, "llama", 2)},
    4: {"pp=2,fsdp=2": ("pp=2,fsdp=2", 2, False, "llama", 1), "pp=2,dp=2": ("pp=2,dp=2", 2, False, "llama", 1),
        "pp=2,fsdp=2, 2 repeats": ("pp=2,fsdp=2", 2, False, "llama", 2),
        "moe pp=2,ep=2": ("pp=2,ep=2", 2, False, "moe", 1), "moe pp=2,ep=2 compiled": ("pp=2,ep=2", 2, True, "moe", 1),
        "pp=2,tp=2": ("pp=2,tp=2", 2, False, "llama", 1), "pp=2,cp=2": ("pp=2,cp=2", 2, False, "llama", 1)},
}


def setup(model_name: str = "llama"):
    """(model, tx, state, batches, loss_fn): the same on every process and in the one-device reference."""
    from ember import optim
    from ember.core import TrainState, random
    from ember.models import build_model, lm_loss

    family, config = MODELS[model_name]
    model = build_model(family, "tiny", **config)
    tx = optim.sgd(LR)
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))
    tokens = random.randint(random.key(2), (STEPS, BATCH, SEQ + 1), 0, LLAMA["vocab_size"])
    segment_ids = torch.ones(BATCH, SEQ, dtype=torch.int64)
    segment_ids[:, SEQ // 2:] = 2  # two packed documents a row: the mask travels with its microbatch
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:], "segment_ids": segment_ids} for t in tokens]
    return model, tx, state, batches, lm_loss(model)


def _run(mesh_text: str, world: int, microbatches: int, compiled: bool, model_name: str, repeats: int) -> dict:
    from ember.core.jit import jit
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.partition_specs.pipeline import PipelineSchedule
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step

    model, tx, state, batches, loss_fn = setup(model_name)
    mesh = Mesh.parse(mesh_text, devices=world, backend="dtensor")
    sharding = Sharding(mesh, for_mesh(mesh.names), pipeline=PipelineSchedule(microbatches, repeats))
    low = sharding.lowering
    if "cp" in mesh:  # each sequence in cp's head-tail order, its positions carried
        batches = [in_context_order(b, mesh.sizes()["cp"]) for b in batches]
    state = shard(state, sharding, axes=model.axes)
    step = train_step(loss_fn, tx)
    if compiled:
        step = jit(step, backend="inductor")
    with use_sharding(sharding):
        grads = grads_of(loss_fn, state.params, shard_batch(batches[0], sharding))
        losses = []
        for batch in batches:
            state, metrics = step(state, shard_batch(batch, sharding))
            losses.append(float(low.gather(metrics["loss"])))
    return {"losses": losses,
            "grads": {p: low.gather(g).tolist() for p, g in tree_leaves_with_path(grads)},
            "params": {p: low.gather(x).tolist() for p, x in tree_leaves_with_path(state.params)},
            "local": {p: list(low.local_shape(x)) for p, x in tree_leaves_with_path(state.params)}}


if __name__ == "__main__":
    serve(CASES, _run, __doc__)
