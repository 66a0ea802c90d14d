"""List a run's checkpoints and export their parameters.

    python launch/ckpt.py list runs/default/checkpoints
    python launch/ckpt.py export runs/default/checkpoints --out model.safetensors         # latest step
    python launch/ckpt.py export runs/default/checkpoints --step 200 --hf --out hf_model/  # Hugging Face folder

`export` reads only the parameters (no optimizer state), on the CPU. `--hf` writes `config.json` +
`model.safetensors` loadable by `transformers.AutoModelForCausalLM.from_pretrained` (GPT-2 and Llama-3).
"""

import argparse
import json
import sys
import typing

from ember.launch.cli import run_main


def _config_from_dict(d):
    """The model config dataclass `ember.core.dataclass_json.to_dict` recorded (nested dataclasses too)."""
    import dataclasses

    import ember.models as models

    cls = getattr(models, d["__type__"])
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        v = d.get(f.name, f.default)
        if isinstance(v, dict) and "__type__" in v:
            options = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)]
            sub = next(t for t in options if t.__name__ == v["__type__"])
            v = sub(**{k: x for k, x in v.items() if k != "__type__"})
        kw[f.name] = v
    return cls(**kw)


def list_checkpoints(directory, out=sys.stdout):
    from ember.core.checkpoint import CheckpointManager

    with CheckpointManager(directory, read_only=True) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            ckpt.read_meta()  # raises CheckpointError naming what the directory holds instead
        print(f"{len(steps)} checkpoints in {ckpt.directory}", file=out)
        print(f"{'step':>8}  {'saved (UTC)':<25} {'model':<22} {'params':>10} {'size MB':>9}  metrics", file=out)
        for step in steps:
            meta = ckpt.read_meta(step)
            model = meta.model or {}
            name = "/".join(str(x) for x in (model.get("family"), model.get("arch")) if x) or "-"
            n_params = sum(leaf.size for leaf in meta.leaves if leaf.path.startswith("params."))
            metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(meta.metrics.items()))
            size = ckpt.disk_bytes(step) / 2**20
            print(f"{step:>8}  {meta.saved_at:<25} {name:<22} {n_params:>10,} {size:>9.1f}  {metrics}", file=out)
    return steps


def export(directory, *, step=None, out, hf=False):
    import torch
    from ember.core import random
    from ember.core.checkpoint import CheckpointManager

    with CheckpointManager(directory, read_only=True) as ckpt:
        meta = ckpt.read_meta(step)
        if not hf:
            from safetensors.torch import save_file

            params = ckpt.restore_params(meta.step)
            seen, tensors = set(), {}
            for name, t in params.items():  # safetensors refuses two names for one tensor (tied weights)
                tensors[name] = t.clone() if id(t) in seen else t
                seen.add(id(t))
            header = {"step": str(meta.step), "model": json.dumps(meta.model), "format": "ember-params"}
            save_file(tensors, out, metadata=header)
            return out
        from ember.models import build_model, to_hf

        if not meta.model or not meta.model.get("config"):
            raise ValueError(f"step {meta.step} records no model config, so --hf cannot rebuild the model; "
                             f"export plain safetensors (drop --hf) instead.")
        model = build_model(meta.model["family"], _config_from_dict(meta.model["config"]))
        with torch.device("meta"):
            like = model.init(random.key(0))  # shapes only: no memory, no init cost
        to_hf(model, ckpt.restore_params(meta.step, like=like, model_info=meta.model), out)
        return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="steps, time, model, parameter count, size and metrics").add_argument("directory")
    e = sub.add_parser("export", help="parameters to safetensors (or a Hugging Face folder with --hf)")
    e.add_argument("directory")
    e.add_argument("--step", type=int, default=None, help="the step to export (default: the latest)")
    e.add_argument("--out", required=True, help="output .safetensors file (a folder with --hf)")
    e.add_argument("--hf", action="store_true", help="write a Hugging Face folder (GPT-2 / Llama-3)")
    args = p.parse_args(argv)
    if args.cmd == "list":
        return list_checkpoints(args.directory)
    path = export(args.directory, step=args.step, out=args.out, hf=args.hf)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    sys.exit(run_main(main))
