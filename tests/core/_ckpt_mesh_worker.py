"""Workers for `test_checkpoint_mesh.py`: checkpoints moving between one device, DTensor meshes and XLA.

    python tests/core/_ckpt_mesh_worker.py dtensor OUT SINGLE_DIR MULTI_DIR   # 4 gloo processes
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/core/_ckpt_mesh_worker.py xla OUT SINGLE_DIR MULTI_DIR

`dtensor` spawns 4 gloo processes. Each restores the single-device checkpoint in SINGLE_DIR onto
`dp=2,tp=2` and `fsdp=4` (the manager joins jax.distributed, so every process reads only its own
shards) and takes one more step; then trains one step on `dp=2,tp=2` from the fresh state and saves
it into MULTI_DIR with every process writing its own shards, and restores that on `fsdp=4` and
`dp=2,tp=2`, one more step each. `xla` restores both checkpoints under torch_xla SPMD on
`fsdp=2,tp=2` and takes one more step (`jit(backend="xla")`). Results go to OUT/<kind>.json and
gathered parameters to OUT/<name>.pt (rank 0).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _processes
from _processes import end_gloo_rank  # noqa: E402

LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16)
BATCH, SEQ = 8, 16
PROBE = "blocks.mlp.gate.weight"  # its local shard shape shows the restored layout (layers stacked first)


def setup(seed: int = 0):
    """(model, tx, state, batches): the same in every process; `batches[0]` before the save, `[1]` after."""
    from ember import optim
    from ember.core import TrainState, random
    from ember.models import build_model

    model = build_model("llama3", "tiny", **LLAMA)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-3, weight_decay=0.1))
    state = TrainState.create(params=model.init(random.key(seed)), tx=tx, key=random.key(1))
    tokens = random.randint(random.key(2), (2, BATCH, SEQ + 1), 0, LLAMA["vocab_size"])
    return model, tx, state, [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def params_of(state, gather=lambda x: x):
    from ember.core.pytree import tree_leaves_with_path

    return {p: gather(x).detach().cpu().clone() for p, x in tree_leaves_with_path(state.params)}


def after(batches):
    """The batches of the steps after the checkpoint (step 1 saved; steps 2 and 3)."""
    return [batches[1], batches[0]]


def _restored_run(ckpt, text, backend, model, tx, like, batches, name, out, rank):
    """Restore into mesh `text` and take the steps of `batches`: the losses, a shard shape, timing."""
    from ember.core.jit import jit
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh, shard_batch, use_sharding
    from ember.core.step_fns import train_step
    from ember.models import lm_loss

    start = time.perf_counter()
    mesh = Mesh.parse(text, devices=4, backend=backend)
    sharding = Sharding(mesh, for_mesh(mesh.names))
    low = sharding.lowering
    state, _, meta = ckpt.restore(like=like, sharding=sharding, axes=model.axes)
    restore_s = time.perf_counter() - start
    local = list(low.local_shape(state.params["blocks"]["mlp"]["gate"]["weight"]))
    params = params_of(state, low.gather)  # collective on DTensor meshes
    step = train_step(lm_loss(model), tx)
    if backend == "xla":
        step = jit(step, backend="xla")
    losses = []
    with use_sharding(sharding):
        for b in batches:  # the second loss also depends on the restored optimizer state
            state, metrics = step(state, shard_batch(b, sharding))
            losses.append(float(low.gather(metrics["loss"])))
    if rank == 0:
        torch.save(params, os.path.join(out, name + ".pt"))
    return {"losses": losses, "local": local, "step": meta.step, "restore_s": restore_s}


def _dtensor(rank: int, world: int, out: str, single_dir: str, multi_dir: str) -> None:
    import torch.distributed as dist

    from ember.core.checkpoint import CheckpointManager
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.step_fns import train_step
    from ember.models import lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), world), rank=rank, world_size=world)
    results = {}
    try:
        model, tx, state0, batches = setup()
        like = setup(seed=7)[2]  # other values: everything must come from the checkpoint
        try:
            with CheckpointManager(single_dir, read_only=True) as ckpt:
                for text in ("dp=2,tp=2", "fsdp=4"):
                    results[f"single->{text}"] = _restored_run(ckpt, text, "dtensor", model, tx, like, after(batches),
                                                               f"single_on_{text}", out, rank)
        except Exception:
            results["single_error"] = traceback.format_exc()[-4000:]
        mesh = Mesh.parse("dp=2,tp=2", devices=world, backend="dtensor")
        sharding = Sharding(mesh, for_mesh(mesh.names))
        step = train_step(lm_loss(model), tx)
        with use_sharding(sharding):
            state1, m0 = step(shard(state0, sharding, axes=model.axes), shard_batch(batches[0], sharding))
            state, losses = state1, []
            for b in after(batches):  # the same mesh without a checkpoint in between
                state, m = step(state, shard_batch(b, sharding))
                losses.append(float(sharding.lowering.gather(m["loss"])))
        saved = params_of(state1, sharding.lowering.gather)
        results["multi_saved"] = {"losses": losses}
        if rank == 0:
            torch.save(saved, os.path.join(out, "multi_saved.pt"))
        start = time.perf_counter()
        with CheckpointManager(multi_dir, save_every=1) as ckpt:
            ckpt.save(1, state1, metrics={"loss": m0["loss"]})
            ckpt.wait()
            results["multi_saved"]["save_s"] = time.perf_counter() - start
            for text in ("fsdp=4", "dp=2,tp=2"):
                results[f"multi->{text}"] = _restored_run(ckpt, text, "dtensor", model, tx, like, after(batches),
                                                          f"multi_on_{text}", out, rank)
        results["process_files"] = sorted(os.listdir(os.path.join(multi_dir, "1", "params")))
        results["process_bytes"] = _process_bytes(os.path.join(multi_dir, "1", "params"))
        results["params_bytes"] = sum(x.numel() * x.element_size() for x in saved.values())
        results["odd_s"] = _save_odd(out)
    except Exception:
        results["error"] = traceback.format_exc()[-4000:]
    if rank == 0:
        with open(os.path.join(out, "dtensor.json"), "w") as f:
            json.dump(results, f, indent=1)
    end_gloo_rank()


def _process_bytes(item: str) -> dict:
    """`{"ocdbt.process_0": bytes, ...}`: what each process wrote into an orbax item."""
    out = {}
    for name in sorted(os.listdir(item)):
        if name.startswith("ocdbt.process_"):
            out[name] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(item, name)) for f in fs)
    return out


def _save_odd(out: str) -> float:
    """Save DTensors jax cannot describe as shards: 5 rows over 4 ranks (saved whole) and a pending sum."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    from ember.core.checkpoint import CheckpointManager
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh

    start = time.perf_counter()
    mesh = Mesh.parse("fsdp=4", devices=4, backend="dtensor")
    dm = Sharding(mesh, for_mesh(mesh.names)).lowering.device_mesh
    odd = distribute_tensor(torch.arange(10.0).reshape(5, 2), dm, [Shard(0)])
    rank = torch.distributed.get_rank()
    pending = DTensor.from_local(torch.arange(6.0) * (rank + 1), dm, [Partial()])  # sums to arange(6) * 10
    with CheckpointManager(os.path.join(out, "odd"), async_save=False) as ckpt:
        ckpt.save(0, {"params": {"odd": odd, "pending": pending}})
    return time.perf_counter() - start


def _xla(out: str, single_dir: str, multi_dir: str) -> None:
    from ember.core.checkpoint import CheckpointManager
    from ember.core.partition_specs.xla import enable_spmd

    enable_spmd()  # before any XLA tensor
    model, tx, _, batches = setup()
    like = setup(seed=7)[2]
    results = {}
    for name, where in (("single", single_dir), ("multi", multi_dir)):
        try:
            with CheckpointManager(where, read_only=True) as ckpt:
                results[f"{name}->fsdp=2,tp=2"] = _restored_run(ckpt, "fsdp=2,tp=2", "xla", model, tx, like, after(batches),
                                                                f"{name}_on_xla", out, 0)
        except Exception:
            results[f"{name}_error"] = traceback.format_exc()[-4000:]
    with open(os.path.join(out, "xla.json"), "w") as f:
        json.dump(results, f, indent=1)


def main(argv) -> None:
    kind, out, single_dir, multi_dir = argv
    os.makedirs(out, exist_ok=True)
    if kind == "dtensor":
        import torch.multiprocessing as mp

        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
        mp.spawn(_dtensor, args=(4, out, single_dir, multi_dir), nprocs=4)
    else:
        _xla(out, single_dir, multi_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
