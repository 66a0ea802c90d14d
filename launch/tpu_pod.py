"""Train with torch_xla SPMD: on a TPU pod (one process per host), or simulated on virtual CPU devices.

    python launch/tpu_pod.py --mesh dp=8,tp=4 --steps 5            # no TPU here: 32 virtual CPU devices
    python launch/tpu_pod.py --mesh fsdp=2,tp=2 --steps 3 --data.batch_size 8 --model.n_layers 2
    python launch/tpu_pod.py --mesh dp=-1,tp=4 --config llama3_tiny   # on every host of a TPU pod slice
    python launch/tpu_pod.py --mesh dp=2,tp=2 --out runs/pod --checkpoint_every 50 --resume   # continue a run

Prints the mesh, each parameter's PartitionSpec and shard shape, memory per device, then each
step's loss and XLA compile count. With `--out DIR` it checkpoints to `DIR/checkpoints` (at the end, and
every `--checkpoint_every` steps if given) and `--resume` continues from the latest one, which
may have been written on another mesh or by `launch/train.py`. `--check` (default on CPU; `--no-check`) also trains the
single-device eager reference and fails unless the losses agree within 1e-4 (float32) and only
step 1 compiled. Without TPUs or PJRT_DEVICE it re-runs itself with `PJRT_DEVICE=CPU
CPU_NUM_DEVICES=<mesh size>`. On TPUs the mesh follows the torus, ICI x DCN across slices
(`ember.core.partition_specs.xla.xla_mesh`). Also `--config NAME`, `--import PKG`, and dotted
config overrides as in `launch/train.py`.
"""

import argparse
import dataclasses
import os
import subprocess
import sys

from ember.core.partition_specs import MESH_ORDER
from ember.launch import cli
from ember.launch.quiet import quiet_xla_logging


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


def _checkpoints_at_the_end(cfg, argv):
    """`cfg` with `--out` checkpointing at the end at least (as documented); without --out (the run config's
    own `out` included), as it is."""
    given = any(a == "--out" or a.startswith("--out=") for a in argv)
    if not given or cfg.out is None or cfg.checkpoint_every >= 0:
        return cfg
    print(f"checkpoints: at the end, in {cfg.out}/checkpoints (--checkpoint_every N also saves every N steps)")
    return dataclasses.replace(cfg, checkpoint_every=0)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = cli.launcher_parser()
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="also train the single-device eager reference and compare losses (default: on CPU)")
    args, overrides = p.parse_known_args(argv)
    if {"-h", "--help"} & set(overrides) or args.list_configs:  # the config's flags, from tyro (exits)
        cli.read_config(args, overrides, description=__doc__, parser=p)
    if args.mesh is None:
        p.error(f"--mesh is required, e.g. --mesh dp=2,tp=2 (axes {', '.join(MESH_ORDER)}; sizes multiply to the "
                f"device count)")
    quiet_xla_logging()  # before torch_xla is imported, here and in the simulating child
    rc = _simulate(argv, args.mesh)
    if rc is not None:
        return rc
    from ember.core.partition_specs.xla import enable_spmd

    enable_spmd()  # before any XLA tensor exists
    import torch_xla.runtime as xr

    from ember.launch import spmd_run
    from ember.launch.interrupt import GracefulStop
    from ember.launch.run_dir import claim_run_directory
    from ember.launch.trackers import check_trackers

    cfg = _checkpoints_at_the_end(cli.read_config(args, overrides, description=__doc__, parser=p), argv)
    check_trackers(cfg.log)  # --log.wandb / --log.mlflow without the package: one line, before the run directory
    say = print if xr.process_index() == 0 else (lambda *a, **k: None)
    with claim_run_directory(cfg.out if xr.process_index() == 0 else None, resume=args.resume), GracefulStop() as stop:
        return spmd_run.train(cfg, args, say=say, stop=stop)


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
