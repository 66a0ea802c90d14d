"""What `launch/ckpt.py` builds on: a run directory's checkpoints, the listing's rows, the model config.

    root = checkpoint_root("runs/default")            # runs/default/checkpoints
    row, problems = step_row(ckpt, 200, verify=True)  # problems: empty when the step is intact
    hint = recovery_hint(root, {100: [], 200: problems})
    adapted = lora_of_run(model, meta.config)          # the LoRAModel a `--lora.rank R` run trained, or None
    unfinished_saves(root)                            # [(300, "300.orbax-checkpoint-tmp-1712345678")]
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ember.core.checkpoint import TMP_MARKER, CheckpointError, disk_bytes, temporary_dirs
from ember.launch.checkpointing import CHECKPOINTS_DIR

__all__ = ["HEADER", "checkpoint_root", "listing_rows", "lora_of_run", "missing_step_message", "model_config_from_dict",
           "recovery_hint", "step_row", "unfinished_saves"]

HEADER = f"{'step':>8}  {'saved (UTC)':<25} {'model':<22} {'params':>10} {'size MB':>9}  metrics"


def _holds_steps(path: pathlib.Path) -> bool:
    """True if `path` has step folders (`200/`, or an unfinished `200.orbax-checkpoint-tmp/`), or is one."""
    is_step = (path / "_CHECKPOINT_METADATA").is_file()  # CheckpointManager says to pass its parent
    return is_step or any(p.is_dir() and p.name.split(".", 1)[0].isdigit() for p in path.iterdir())


def _contents(path: pathlib.Path, limit: int = 6) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "")


def checkpoint_root(directory: str) -> str:
    """The checkpoint directory to read: `directory` itself when it holds steps, else its
    `checkpoints/` folder (`directory` is a run's `--out`).

    Raises:
        CheckpointError: `directory` holds neither; says what it holds and what to pass.
    """
    path = pathlib.Path(directory).expanduser()
    if not path.is_dir() or _holds_steps(path):
        return directory  # CheckpointManager explains a missing path, a file, a single step
    if (path / CHECKPOINTS_DIR).is_dir():
        return str(path / CHECKPOINTS_DIR)
    from ember.launch.run_dir import run_files

    if run_files(directory):
        raise CheckpointError(
            f"{directory} is a run directory without checkpoints (it contains {_contents(path)}): the run saved "
            f"none. Train it with `--checkpoint_every N` to save them, or pass another run's directory."
        )
    raise CheckpointError(
        f"{directory} holds no checkpoints and no {CHECKPOINTS_DIR}/ folder (it contains {_contents(path)}). "
        f"Pass a run directory (the --out of launch/train.py) or its {CHECKPOINTS_DIR}/ folder."
    )


def step_row(ckpt: Any, step: int, *, verify: bool) -> Tuple[str, List[str]]:
    """The listing's line for `step` and what is wrong with the step (empty: intact).

    `verify` reads every array and checks its CRC-32; without it only the metadata is read.
    """
    size = ckpt.disk_bytes(step) / 2**20
    problems = ckpt.verify(step) if verify else []
    try:
        meta = ckpt.read_meta(step)
    except CheckpointError:
        problems = problems or ckpt.verify(step)  # names why the metadata cannot be read
        return f"{step:>8}  {'-':<25} {'-':<22} {'-':>10} {size:>9.1f}  DAMAGED: {'; '.join(problems)}", problems
    model = meta.model or {}
    name = "/".join(str(x) for x in (model.get("family"), model.get("arch")) if x) or "-"
    n_params = sum(leaf.size for leaf in meta.leaves if leaf.path.startswith("params."))
    metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(meta.metrics.items()))
    damaged = f"  DAMAGED: {'; '.join(problems)}" if problems else ""
    return f"{step:>8}  {meta.saved_at:<25} {name:<22} {n_params:>10,} {size:>9.1f}  {metrics}{damaged}", problems


def unfinished_saves(root: str) -> List[Tuple[int, str]]:
    """`(step, folder name)` of each save a process never committed (killed mid-save), by step."""
    path = pathlib.Path(root).expanduser()
    found = []
    for name in temporary_dirs(path):  # orbax writes step N into N.orbax-checkpoint-tmp-<time>, then renames it
        head = name.partition(TMP_MARKER)[0]
        if head.isdigit() and (path / name).is_dir():
            found.append((int(head), name))
    return sorted(found)


def _unfinished_row(root: str, step: int, name: str) -> str:
    """The listing's line for an unfinished save (no metadata to read: only its size)."""
    size = disk_bytes(pathlib.Path(root) / name) / 2**20
    return (f"{step:>8}  {'-':<25} {'-':<22} {'-':>10} {size:>9.1f}  UNFINISHED: {name}/ never committed "
            f"(the process stopped mid-save)")


def _unfinished_hint(unfinished: List[Tuple[int, str]]) -> Optional[str]:
    """One line after a listing with unfinished saves: they are no checkpoint, and what to do (None: none)."""
    if not unfinished:
        return None
    names = ", ".join(f"{name}/" for _, name in unfinished)
    which, it = (f"{len(unfinished)} unfinished saves ({names})", "them") if len(unfinished) > 1 else \
        (f"1 unfinished save ({names})", "it")
    return (f"{which}: not a checkpoint. `--resume` skips {it} (the run removes {it}, logged) and restores the "
            f"latest committed step; deleting {it} by hand is safe.")


def missing_step_message(root: str, step: int, steps: List[int]) -> str:
    """Why `--step N` names no checkpoint: the steps that exist, an unfinished save of N, and the fix."""
    unfinished = [name for s, name in unfinished_saves(root) if s == step]
    why = (f"step {step} was never committed ({unfinished[0]}/: the process stopped mid-save)" if unfinished
           else f"no checkpoint for step {step}")
    return (f"{why} in {root}; saved steps: {', '.join(map(str, steps))}. Pass --step with one of those, "
            f"or leave --step out for the latest ({steps[-1]}).")


def listing_rows(ckpt: Any, root: str, *, verify: bool) -> Tuple[List[str], Dict[int, List[str]]]:
    """The listing's lines under its header (steps and unfinished saves by step, then hints), and
    `{step: problems}` of the committed steps (empty: intact)."""
    problems: Dict[int, List[str]] = {}
    rows = []
    for step in ckpt.all_steps():
        row, problems[step] = step_row(ckpt, step, verify=verify)
        rows.append((step, row))
    unfinished = unfinished_saves(root)
    rows += [(step, _unfinished_row(root, step, name)) for step, name in unfinished]
    hints = [h for h in (recovery_hint(root, problems), _unfinished_hint(unfinished)) if h]
    return [row for _, row in sorted(rows, key=lambda r: r[0])] + hints, problems


def recovery_hint(root: str, problems: Mapping[int, List[str]]) -> Optional[str]:
    """One line after a listing with damaged steps: which, and the step to resume from (None: all intact)."""
    damaged = [step for step, found in problems.items() if found]
    if not damaged:
        return None
    intact = [step for step, found in problems.items() if not found]
    which = f"{len(damaged)} damaged step{'s' if len(damaged) > 1 else ''} ({', '.join(map(str, damaged))})"
    if not intact:
        return f"{which}: no step is intact, so nothing here can be resumed or exported."
    if intact[-1] > damaged[-1]:
        return f"{which}; the latest, step {intact[-1]}, is intact (`--resume` restores it)."
    run = pathlib.Path(root)
    out = f" --out {run.parent}" if run.name == CHECKPOINTS_DIR else ""
    return (f"{which}; restore step {intact[-1]}, the newest intact one, with "
            f"`python launch/train.py{out} --resume --resume_step {intact[-1]}` (export: --step {intact[-1]}).")


def model_config_from_dict(d: Dict[str, Any]) -> Any:
    """The model config dataclass `ember.core.dataclass_json.to_dict` recorded (nested dataclasses too)."""
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


def lora_of_run(model: Any, config: Optional[Mapping[str, Any]]) -> Any:
    """The `LoRAModel` over `model` that a run with saved run config `config` trained (`--lora.rank R`), or
    None for a run without LoRA: its checkpoints hold `{"base": ..., "lora": ...}` params."""
    from ember.models.lora import LoRAConfig, to_lora

    lora = (config or {}).get("lora") or {}
    if not lora.get("rank"):
        return None
    cfg = LoRAConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in lora.items() if k != "__type__"})
    return to_lora(model, rank=cfg.rank, alpha=cfg.alpha, targets=cfg.pattern())
