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
optimizer state), on the CPU, and writes files with the mode your umask gives. `--hf` writes
`config.json` + `model.safetensors` loadable by `transformers.AutoModelForCausalLM.from_pretrained`
(GPT-2 and Llama-3).
"""

import argparse
import json
import sys

from ember.launch.cli import run_main
from ember.launch.ckpt_tools import HEADER, checkpoint_root, listing_rows, missing_step_message, model_config_from_dict


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


def export(directory, *, step=None, out, hf=False):
    import torch
    from ember.core import random
    from ember.core.checkpoint import CheckpointError, CheckpointManager
    from ember.models.hf import save_safetensors

    root = checkpoint_root(directory)
    with CheckpointManager(root, read_only=True) as ckpt:
        steps = ckpt.all_steps()
        if step is not None and steps and step not in steps:
            raise CheckpointError(missing_step_message(str(ckpt.directory), step, steps))
        meta = ckpt.read_meta(step)
        if not hf:
            params = ckpt.restore_params(meta.step)
            seen, tensors = set(), {}
            for name, t in params.items():  # safetensors refuses two names for one tensor (tied weights)
                tensors[name] = t.clone() if id(t) in seen else t
                seen.add(id(t))
            header = {"step": str(meta.step), "model": json.dumps(meta.model), "format": "ember-params"}
            save_safetensors(tensors, out, metadata=header)
            return out
        from ember.models import build_model, to_hf

        if not meta.model or not meta.model.get("config"):
            raise ValueError(f"step {meta.step} records no model config, so --hf cannot rebuild the model; "
                             f"export plain safetensors (drop --hf) instead.")
        model = build_model(meta.model["family"], model_config_from_dict(meta.model["config"]))
        with torch.device("meta"):
            like = model.init(random.key(0))  # shapes only: no memory, no init cost
        to_hf(model, ckpt.restore_params(meta.step, like=like, model_info=meta.model), out)
        return out


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
    e.add_argument("--hf", action="store_true", help="write a Hugging Face folder (GPT-2 / Llama-3)")
    args = p.parse_args(argv)
    if args.cmd == "list":
        return 1 if any(list_checkpoints(args.directory, verify=args.verify).values()) else 0
    path = export(args.directory, step=args.step, out=args.out, hf=args.hf)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    sys.exit(run_main(main))
