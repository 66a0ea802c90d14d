"""One step on a 2-device mesh against the single-device reference, for the step_fns mesh tests.

    python tests/step_fns/_mesh_parity.py dtensor CASE OUT_DIR      # 2 gloo processes
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python tests/step_fns/_mesh_parity.py xla CASE OUT_DIR

Cases: `token_weighting` (dp=2; `_token_weighting.make_case` puts more valid tokens on rank 0's
rows than on rank 1's) and `chunked_loss` (tp=2, a vocab-sharded Llama head and
`loss_chunk_size` and remat "full", against the plain loss on one device). For every seed and `microbatches` in
(1, 2) the sharded step (eager and compiled) runs once with SGD(lr=1); its loss, token count and
gradients are written to OUT_DIR/results.json beside the reference's, and for `token_weighting` the
rows of `x` that each call of the loss held on one device (`rows`).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _processes
import _token_weighting  # noqa: E402
from _processes import end_gloo_rank  # noqa: E402

SEEDS = _token_weighting.SEEDS
MICROBATCHES = (1, 2)
LLAMA = dict(vocab_size=96, d_model=32, n_heads=4, n_kv_heads=2, n_layers=1, ffn_dim=64, max_seq_len=16)


ROWS_SEEN = []  # per call of `loss_with_rows_seen`, the rows of `x` this device held (at trace time when compiled)


def loss_with_rows_seen(params, batch, *, key):
    x = batch["x"]
    ROWS_SEEN.append(int((x.to_local() if hasattr(x, "to_local") else x).shape[0]))
    return _token_weighting.loss_fn(params, batch, key=key)


def token_weighting(seed):
    """(mesh, reference loss_fn, sharded loss_fn, params, batch, axes)."""
    params, batch = _token_weighting.make_case(seed)
    axes = {"w1": ("embed", "mlp"), "w2": ("mlp", "vocab")}
    return "dp=2", _token_weighting.loss_fn, loss_with_rows_seen, params, batch, axes


def chunked_loss(seed):
    from ember.core import random
    from ember.models import build_model, lm_loss

    plain = build_model("llama3", "tiny", **LLAMA)
    chunked = build_model("llama3", "tiny", **LLAMA, loss_chunk_size=6, remat="full")  # remat's barrier on DTensors
    tokens = random.randint(random.key(seed + 100), (4, 13), 0, LLAMA["vocab_size"])
    targets = tokens[:, 1:].clone()
    targets[:2, :7] = -100
    batch = {"inputs": tokens[:, :-1], "targets": targets}
    params = plain.init(random.key(seed))
    return "tp=2", lm_loss(plain, z_loss=1e-4), lm_loss(chunked, z_loss=1e-4), params, batch, plain.axes


CASES = {"token_weighting": token_weighting, "chunked_loss": chunked_loss}


def one_step(loss_fn, params, batch, microbatches, *, backend, sharding=None, axes=None):
    """`{loss, tokens, grads}` of one SGD(lr=1) step, gathered to full CPU tensors (lists)."""
    from ember import optim
    from ember.core import TrainState, random
    from ember.core.jit import jit
    from ember.core.partition_specs import shard, shard_batch, use_sharding
    from ember.core.pytree import tree_leaves_with_path
    from ember.core.step_fns import train_step

    state = TrainState.create(params=params, tx=optim.sgd(1.0), key=random.key(9))
    ROWS_SEEN.clear()
    step = train_step(loss_fn, microbatches=microbatches)
    step = jit(step, backend=backend) if backend != "eager" else step
    if sharding is None:
        new, metrics = step(state, batch)
        gather = lambda x: x  # noqa: E731
    else:
        gather = sharding.lowering.gather
        with use_sharding(sharding):
            new, metrics = step(shard(state, sharding, axes=axes), shard_batch(batch, sharding))
    before = dict(tree_leaves_with_path(params))
    grads = {p: (before[p] - gather(x).cpu()).tolist() for p, x in tree_leaves_with_path(new.params)}
    return {"loss": float(gather(metrics["loss"])), "tokens": float(gather(metrics["tokens"])), "grads": grads,
            "rows": sorted(set(ROWS_SEEN))}


def run_all(case, backends, mesh_backend, devices):
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh

    results = {}
    for seed in SEEDS:
        mesh_text, reference_fn, sharded_fn, params, batch, axes = CASES[case](seed)
        mesh = Mesh.parse(mesh_text, devices=devices, backend=mesh_backend)
        sharding = Sharding(mesh, for_mesh(mesh.names))
        results[f"{seed}/reference"] = one_step(reference_fn, params, batch, 1, backend="eager")
        for backend in backends:
            for m in MICROBATCHES:
                results[f"{seed}/{backend}/{m}"] = one_step(sharded_fn, params, batch, m, backend=backend,
                                                            sharding=sharding, axes=axes)
    return results


def _dtensor_worker(rank: int, case: str, out: str) -> None:
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(1)
    # A microbatch loop over DTensors once tripped torch's missing DTensor rule for invoke_subgraph,
    # which turned ember's patches off for the process with a warning: that must not recur.
    warnings.filterwarnings("error", message=r"ember's torch patch\(es\) .* failed")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), 2), rank=rank, world_size=2)
    results = run_all(case, ("eager", "inductor"), "dtensor", 2)
    if rank == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f)
    end_gloo_rank()


if __name__ == "__main__":
    kind, case_name, out_dir = sys.argv[1:4]
    os.makedirs(out_dir, exist_ok=True)
    if kind == "dtensor":
        import torch.multiprocessing as mp

        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
        mp.spawn(_dtensor_worker, args=(case_name, out_dir), nprocs=2)
    else:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(run_all(case_name, ("xla",), "xla", 2), f)
