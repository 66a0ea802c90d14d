"""Train with torch_xla SPMD: on a TPU pod (one process per host), or simulated on virtual CPU devices.

    python launch/tpu_pod.py --mesh dp=8,tp=4 --steps 5            # no TPU here: 32 virtual CPU devices
    python launch/tpu_pod.py --mesh fsdp=2,tp=2 --steps 3 --data.batch_size 8 --model.n_layers 2
    python launch/tpu_pod.py --mesh dp=-1,tp=4 --config llama3_tiny   # on every host of a TPU pod slice
    python launch/tpu_pod.py --mesh dp=2,tp=2 --out runs/pod --checkpoint_every 50 --resume   # continue a run

Prints the mesh, each parameter's PartitionSpec and shard shape, memory per device, then each
step's loss and XLA compile count. With `--out DIR` it checkpoints to `DIR/checkpoints` (every
`--checkpoint_every` steps and at the end) and `--resume` continues from the latest one, which
may have been written on another mesh or by `launch/train.py`. `--check` (default on CPU; `--no-check`) also trains the
single-device eager reference and fails unless the losses agree within 1e-4 (float32) and only
step 1 compiled. Without TPUs or PJRT_DEVICE it re-runs itself with `PJRT_DEVICE=CPU
CPU_NUM_DEVICES=<mesh size>`. On TPUs the mesh follows the torus, ICI x DCN across slices
(`ember.core.partition_specs.xla.xla_mesh`). Also `--config NAME`, `--import PKG`, and dotted
config overrides as in `launch/train.py`.
"""

import argparse
import os
import subprocess
import sys
import time

from ember.launch import cli


def _simulate(argv, mesh_text):
    """Re-run this script on `mesh size` virtual CPU devices when there is no TPU and no PJRT_DEVICE."""
    if os.environ.get("PJRT_DEVICE"):
        return None
    from ember.core.xla import require_torch_xla

    require_torch_xla("launch/tpu_pod.py")
    from ember.core.compat.torch_xla import tpu_chip_count

    if tpu_chip_count() > 0:
        return None
    from ember.core.mesh import Mesh

    n = Mesh.parse(mesh_text, backend="xla").size  # -1 needs a device count: give every size here
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(n))
    print(f"no TPU and no PJRT_DEVICE: simulating on {n} virtual CPU devices (PJRT_DEVICE=CPU CPU_NUM_DEVICES={n})")
    return subprocess.call([sys.executable, os.path.abspath(__file__), *argv], env=env)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = cli.launcher_parser()
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None)
    args, overrides = p.parse_known_args(argv)
    if {"-h", "--help"} & set(overrides):  # the config's flags, from tyro (exits)
        cli.read_config(args, ["--help"], description=__doc__ + "\nLauncher flags: --mesh, --check/--no-check.")
    if args.mesh is None:
        p.error("--mesh is required, e.g. --mesh dp=2,tp=2 (axes dp, fsdp, tp; sizes multiply to the device count)")
    rc = _simulate(argv, args.mesh)
    if rc is not None:
        return rc
    from ember.core.partition_specs.xla import enable_spmd

    enable_spmd()  # before any XLA tensor exists
    import torch_xla.runtime as xr

    from ember import data
    from ember.core import jit
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.partition_specs.report import describe_sharding
    from ember.launch import build, checkpointing

    cfg = cli.read_config(args, overrides, description=__doc__)
    check = args.check if args.check is not None else os.environ.get("PJRT_DEVICE", "").upper() == "CPU"
    say = print if xr.process_index() == 0 else (lambda *a, **k: None)
    model = build.build_model(cfg)
    tokenizer = build.build_tokenizer(cfg, model)
    mesh = Mesh.parse(args.mesh, devices=xr.global_runtime_device_count(), backend="xla")
    sharding = Sharding(mesh, for_mesh(mesh.names))
    state0 = build.initial_state(cfg, model)
    say(f"{sharding.lowering!r}, {xr.process_count()} process(es)")
    say(describe_sharding(state0, sharding, axes=model.axes))
    data_iter = data.build_batches(cfg.data, tokenizer=tokenizer)
    ckpt, info = checkpointing.build_manager(cfg), checkpointing.model_info_for(cfg, arch=args.config)
    state = checkpointing.maybe_resume(ckpt, shard(state0, sharding, axes=model.axes), data_iter, cfg=cfg,
                                        resume=args.resume, model_info=info, sharding=sharding, axes=model.axes,
                                        log=say)
    first = int(state.step)
    step_fn = build.step_fn(cfg, model)
    step = jit(step_fn, backend="xla", donate="state")
    losses, compiles, batches = [], [], []
    start = time.perf_counter()
    with use_sharding(sharding):
        for n, batch in zip(range(first + 1, cfg.steps + 1), data_iter):
            before = step.compile_count
            state, metrics = step(state, shard_batch(batch, sharding))
            compiles.append(step.compile_count - before)
            losses.append(metrics["loss"])
            batches.append(batch)
            checkpointing.save_if_due(ckpt, n, state, data_iter, cfg=cfg, model_info=info, sharding=sharding)
    checkpointing.finish(ckpt, state, data_iter, cfg=cfg, model_info=info, sharding=sharding)
    losses = [float(sharding.lowering.gather(x)) for x in losses]  # host sync, after the loop
    say(f"trained {len(losses)} steps in {time.perf_counter() - start:.1f}s (step 1 with compiling: "
        f"{step.compile_seconds:.1f}s)")
    for i, (loss, c) in enumerate(zip(losses, compiles)):
        say(f"step {first + i + 1}: loss {loss:.6f}, compiled {c}")
    if not check or first:
        return 0  # (a resumed run has no single-device reference from its own start)
    reference, ref_state, ref_losses = jit(step_fn, backend="eager"), state0, []
    for batch in batches:
        ref_state, metrics = reference(ref_state, batch)
        ref_losses.append(float(metrics["loss"]))
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    say(f"check: max |loss - single-device loss| = {diff:.3g} over {len(losses)} steps; compiles per step {compiles}")
    ok = diff < 1e-4 and compiles == [1] + [0] * (len(compiles) - 1)
    say("check passed" if ok else "CHECK FAILED: expected a loss difference < 1e-4 and one compile, at step 1")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
