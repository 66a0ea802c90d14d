"""List a run's checkpoints (flagging damaged steps) and export their parameters.

    python launch/ckpt.py list runs/default                                   # a run's --out, or its checkpoints/
    python launch/ckpt.py list runs/default --no-verify                       # metadata only: no arrays read
    python launch/ckpt.py export runs/default --out model.safetensors         # latest step
    python launch/ckpt.py export runs/default --step 200 --hf --out hf_model/ # Hugging Face folder

`list` reads every array and checks its CRC-32 (about the checkpoints' size in reads), marks a step
that fails (or whose files cannot be read) `DAMAGED: <why>`, names the newest intact step to resume
from and exits 1; `--no-verify` reads the metadata only. A save a killed process never committed
(`N.orbax-checkpoint-tmp-*/`) is listed `UNFINISHED`, left in place (the next training run on the
directory removes it and says so). `export` reads only the parameters (no
optimizer state), on the CPU, and writes files with the mode your umask gives; it replaces no file
without `--overwrite`. `--hf` writes `config.json` + `model.safetensors` loadable by
`transformers.AutoModelForCausalLM.from_pretrained` (any native family; a LoRA run's adapters merged in),
plus the tokenizer files and chat template of the Hugging Face folder the run read its tokenizer from
(a byte-tokenizer run: a `tokenizer.json` of the same ids; a BPE run, trained in memory, has none to write).
A run trained with `--log.wandb` / `--log.mlflow` (its `trackers.json`) gets the export recorded in those runs.
"""

import argparse
import sys

from ember.launch.cli import run_main
from ember.launch.ckpt_export import export
from ember.launch.ckpt_tools import HEADER, checkpoint_root, listing_rows
from ember.launch.trackers import record_export


def list_checkpoints(directory, *, verify=True, out=None):
    """Print one line per step to `out` (stdout); returns `{step: problems}` (empty: the step is intact)."""
    from ember.core.checkpoint import CheckpointManager

    out = out or sys.stdout
    root = checkpoint_root(directory)
    with CheckpointManager(root, read_only=True) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            ckpt.read_meta()  # raises CheckpointError naming what the directory holds instead
        checked = "every array checked against its CRC-32" if verify else "metadata only, arrays not read"
        print(f"{len(steps)} checkpoints in {ckpt.directory} ({checked})", file=out)
        print(HEADER, file=out)
        rows, problems = listing_rows(ckpt, root, verify=verify)
    print("\n".join(rows), file=out)
    return problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    where = "a run directory (--out of launch/train.py) or its checkpoints/ folder"
    ls = sub.add_parser("list", help="steps, time, model, parameter count, size, metrics; damaged steps marked")
    ls.add_argument("directory", help=where)
    ls.add_argument("--no-verify", dest="verify", action="store_false",
                    help="read the metadata only (no arrays, no CRC-32 check): quick on large checkpoints")
    e = sub.add_parser("export", help="parameters to safetensors (or a Hugging Face folder with --hf)")
    e.add_argument("directory", help=where)
    e.add_argument("--step", type=int, default=None, help="the step to export (default: the latest)")
    e.add_argument("--out", required=True, help="output .safetensors file (a folder with --hf)")
    e.add_argument("--hf", action="store_true", help="write a Hugging Face folder (with the run's tokenizer files)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --out file (or the folder's files)")
    args = p.parse_args(argv)
    if args.cmd == "list":
        return 1 if any(list_checkpoints(args.directory, verify=args.verify).values()) else 0
    path = export(args.directory, step=args.step, out=args.out, hf=args.hf, overwrite=args.overwrite)
    print(f"wrote {path}")
    if recorded := record_export(args.directory, path):  # the run's trackers.json: its W&B / MLflow runs
        print(f"recorded {path} in the run's {' and '.join(recorded)} run")
    return path


if __name__ == "__main__":
    sys.exit(run_main(main))
