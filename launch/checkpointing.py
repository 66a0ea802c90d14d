"""Checkpoint wiring of a run (`launch/train.py`, `tpu_pod.py`): build the manager, resume, save on schedule.

    ckpt = build_manager(cfg)                                    # OUT/checkpoints, or None without --out
    set_aside_steps_after(cfg, 200, main=True)                   # --resume_step 200: later steps moved aside
    state = maybe_resume(ckpt, state, batches, cfg=cfg, resume=True, model_info=info)
    state = train_loop(..., on_step_end=checkpoint_hook(ckpt, batches, cfg=cfg, writer=writer, model_info=info))
    finish(ckpt, state, batches, cfg=cfg, writer=writer, model_info=info)   # last step, wait, close
    already_finished(cfg, resume=True)                           # a notice when --resume has nothing to train
    check_resume_model(cfg, resume=True)                         # one line when the checkpoint holds another model

Run-config fields read (`TrainConfig`):
    out               run directory; checkpoints go to `OUT/checkpoints` (none without it)
    checkpoint_every  steps between checkpoints (and the last step); 0: only the last step; < 0: never
    keep              how many recent checkpoints to keep (0: all)
    keep_best         also keep the best step by this metric: "eval_loss" (lower is better) or
                      "eval_accuracy:max"; None: off
    steps             the run's last step (always saved when checkpointing is on)
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ember.core.checkpoint import CheckpointError, CheckpointManager, model_info
from ember.core.dataclass_json import to_dict
from ember.launch.throughput import THROUGHPUT_KEYS

__all__ = ["CHECKPOINTS_DIR", "already_finished", "build_manager", "check_keep_best", "check_resume_model", "checkpoint_dir",
           "checkpoint_hook", "finish", "maybe_resume", "model_info_for", "save_if_due", "set_aside_steps_after"]

CHECKPOINTS_DIR = "checkpoints"  # under the run directory

_IGNORED_ON_RESUME = {"steps", "out", "log_every", "eval_every", "eval_batches", "sample_tokens", "sample_prompt",
                      "backend", "num_workers", "resume", "checkpoint_every", "keep", "keep_best"}


def checkpoint_dir(cfg: Any) -> Optional[str]:
    """`OUT/checkpoints`, or None when the run has no `out` or checkpointing is off."""
    if cfg.out is None or cfg.checkpoint_every < 0:
        return None
    return os.path.join(cfg.out, CHECKPOINTS_DIR)


def _keep_best(spec: Optional[str]) -> Optional[Tuple[str, str]]:
    if not spec:
        return None
    name, _, mode = spec.partition(":")
    return name, mode or "min"


def build_manager(cfg: Any, *, async_save: bool = True) -> Optional[CheckpointManager]:
    """The run's `CheckpointManager` (None without `out` or with `checkpoint_every < 0`)."""
    directory = checkpoint_dir(cfg)
    if directory is None:
        return None
    every = cfg.checkpoint_every if cfg.checkpoint_every > 0 else max(cfg.steps, 1)
    return CheckpointManager(directory, save_every=every, max_to_keep=cfg.keep or None,
                             keep_best=_keep_best(cfg.keep_best), async_save=async_save)


def check_keep_best(cfg: Any, eval_metrics: Mapping[str, Any]) -> Mapping[str, Any]:
    """`eval_metrics` (a first evaluation's, unprefixed), after checking that `cfg.keep_best` names one of them."""
    keep = _keep_best(cfg.keep_best)
    names = sorted(f"eval_{k}" for k in eval_metrics)
    if keep is not None and keep[0] not in names:
        raise ValueError(f"keep_best={cfg.keep_best!r} names no metric this run evaluates; the evaluation "
                         f"reports {', '.join(names)}: pass e.g. --keep_best {names[0]} (lower is better) "
                         f"or --keep_best {names[0]}:max.")
    return eval_metrics


def _saved_steps(directory: str) -> List[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if re.fullmatch(r"0|[1-9]\d*", n))


def set_aside_steps_after(cfg: Any, step: int, *, main: bool, log: Callable[[str], None] = print) -> None:
    """Check that checkpoint `step` exists, and move newer steps to `OUT/checkpoints-after-<step>` (kept,
    not deleted) so a run resumed from `step` can save those step numbers again. Only `main` moves;
    under torchrun every rank calls it (it waits for the move)."""
    directory = checkpoint_dir(cfg)
    steps = _saved_steps(directory) if directory else []
    if step not in steps:
        raise ValueError(f"--resume_step {step}: no checkpoint for step {step} in {directory}; saved steps: "
                         f"{', '.join(map(str, steps)) or 'none'} (`launch/ckpt.py list {cfg.out}` shows which are intact).")
    later = [s for s in steps if s > step]
    if main and later:
        aside = os.path.join(cfg.out, f"{CHECKPOINTS_DIR}-after-{step}")
        suffix = 1
        while os.path.exists(aside):
            aside, suffix = os.path.join(cfg.out, f"{CHECKPOINTS_DIR}-after-{step}.{suffix}"), suffix + 1
        os.makedirs(aside)
        for s in later:
            os.rename(os.path.join(directory, str(s)), os.path.join(aside, str(s)))
        log(f"resume_step {step}: moved the later checkpoints {later} to {aside} (nothing deleted)")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def already_finished(cfg: Any, *, resume: bool, step: Optional[int] = None) -> Optional[str]:
    """A one-line notice when `--resume` (or `--resume_step step`) would restore a step at or past
    `cfg.steps`: nothing is left to train. None otherwise, and for a damaged latest step (the restore
    names it, and `--resume_step` an earlier one)."""
    directory = checkpoint_dir(cfg)
    steps = _saved_steps(directory) if directory and (resume or step is not None) else []
    start = step if step is not None else (steps[-1] if steps else None)
    if start is None or start not in steps or start < cfg.steps:
        return None
    if step is None:
        with CheckpointManager(directory, read_only=True) as manager:
            if manager.verify(start):
                return None
    return (f"{cfg.out} already reached step {start} of --steps {cfg.steps}: nothing to train, nothing changed. "
            f"Pass a larger --steps (e.g. --steps {start + cfg.steps}) to train on, or --overwrite without "
            f"--resume to start again.")


def check_resume_model(cfg: Any, *, resume: bool, step: Optional[int] = None, config_name: Optional[str] = None) -> None:
    """Before a `--resume` (or `--resume_step step`) touches anything: raise a `CheckpointError` of one line when
    the checkpoint it would restore holds another model than `cfg.model`, naming each differing field and the
    `--model.*` flags (or `--config`) that give the saved one. A damaged or model-less step is left to the
    restore, which names what is wrong."""
    from ember.launch.model_mismatch import FREE_FIELDS, LAYOUT_FIELDS, refusal

    directory = checkpoint_dir(cfg)
    steps = _saved_steps(directory) if directory and (resume or step is not None) else []
    start = step if step is not None else (steps[-1] if steps else None)
    if start is None or start not in steps:
        return
    try:
        with CheckpointManager(directory, read_only=True) as manager:
            saved = manager.read_meta(start).model or {}
    except CheckpointError:
        return
    if not (saved.get("family") and saved.get("config")) or cfg.model is None:
        return
    message = refusal("--resume", f"checkpoint of step {start} in {directory}", saved["family"], saved["config"],
                      cfg.family, to_dict(cfg.model), config_name, purpose="resume it",
                      free=[f for f in FREE_FIELDS if f not in LAYOUT_FIELDS])  # the optimizer state has its layout
    if message:
        raise CheckpointError(message)


def model_info_for(cfg: Any, *, arch: Optional[str] = None) -> Dict[str, Any]:
    """`model_info(cfg.family, cfg.model, arch=arch)`; `arch` is the run config's name (`--config`)."""
    return model_info(cfg.family, cfg.model, arch=arch)


def _config_changes(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any], prefix: str = "") -> list:
    if not saved:
        return []
    out = []
    for k in sorted(set(saved) | set(now)):
        if k in _IGNORED_ON_RESUME or k == "__type__":
            continue
        a, b = saved.get(k, "<missing>"), now.get(k, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_changes(a, b, prefix=f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def maybe_resume(
    manager: Optional[CheckpointManager],
    state: Any,
    batches: Any,
    *,
    cfg: Any,
    resume: bool,
    step: Optional[int] = None,
    model_info: Optional[Mapping[str, Any]] = None,
    sharding: Any = None,
    axes: Any = None,
    log: Callable[[str], None] = print,
) -> Any:
    """The latest checkpoint's state (and data position) when `resume`; otherwise `state` as is.

    Args:
        manager: from `build_manager` (None: checkpointing off).
        state: the freshly initialised state; its structure and `tx` are the restore template.
        batches: the train batch iterator (`TorchBatches`); its position is restored.
        cfg: the run config (config changes since the checkpoint are logged, not refused).
        resume: `--resume`: continue from the latest checkpoint if there is one.
        step: `--resume_step N`: continue from step N instead (implies `resume`; call
            `set_aside_steps_after` first so the later steps can be saved again).
        model_info: the current model's `model_info(...)`, to name differences on a mismatch.
        sharding: place the restored state with this `Sharding` (and `axes=model.axes`).
        log: where the one-line messages go.

    Raises:
        ValueError: `resume` without a checkpoint directory (no `--out`), or checkpoints already in it
            without `resume` (a fresh run would mix two runs' checkpoints).
        CheckpointError: the checkpoint does not fit the model (names the differing leaves).
    """
    resume = resume or step is not None
    if not resume:
        if manager is not None and manager.all_steps():
            raise ValueError(
                f"{manager.directory} already holds checkpoints {manager.all_steps()} from an earlier run; pass "
                f"--resume to continue it, or a new --out for a fresh run (nothing was deleted)."
            )
        return state
    if manager is None:
        raise ValueError(f"--resume needs checkpoints, but this run has none (out={cfg.out!r}, checkpoint_every="
                         f"{cfg.checkpoint_every}): pass the run's --out DIR and --checkpoint_every N (>= 0) as the "
                         f"run being resumed did.")
    if manager.latest_step() is None:
        log(f"resume: no checkpoint in {manager.directory} yet; starting from step 0.")
        return state
    try:
        state, data_state, meta = manager.restore(step, like=state, model_info=model_info, sharding=sharding, axes=axes)
    except CheckpointError as error:
        earlier = [s for s in manager.all_steps() if s < (step if step is not None else manager.latest_step())]
        if not earlier:
            raise
        raise CheckpointError(f"{error} From the launcher: pass --resume_step {earlier[-1]} (an earlier step; "
                              f"`launch/ckpt.py list {cfg.out}` shows which are intact).") from error
    if data_state is not None:
        batches.set_state(data_state)
    changes = _config_changes(meta.config, to_dict(cfg))
    note = f" (config changed: {'; '.join(changes)})" if changes else ""
    log(f"resumed from step {meta.step} of {manager.directory}{note}")
    return state


def _metrics_at(writer: Any, step: int) -> Dict[str, float]:
    """The model metrics logged at `step` (the throughput keys left out: they say nothing of the weights)."""
    merged: Dict[str, float] = {}
    for row in reversed(getattr(writer, "history", []) or []):
        if row.get("step") != step:
            break
        merged = {**{k: v for k, v in row.items() if k != "step" and k not in THROUGHPUT_KEYS}, **merged}
    return merged


def save_if_due(
    manager: Optional[CheckpointManager],
    step: int,
    state: Any,
    batches: Any,
    *,
    cfg: Any,
    metrics: Optional[Mapping[str, Any]] = None,
    model_info: Optional[Mapping[str, Any]] = None,
    sharding: Any = None,
    force: bool = False,
) -> bool:
    """Save step `step` when it is a multiple of `checkpoint_every` (or `force`); True if saved."""
    if manager is None or (not force and not manager.should_save(step)) or step in manager.all_steps():
        return False
    return manager.save(step, state, data_state=batches.get_state(), config=cfg, model_info=model_info,
                        metrics=metrics, force=force, sharding=sharding)


def _record_checkpoint(writer: Any, manager: CheckpointManager, step: int) -> None:
    """Name the saved step's folder to the writer's experiment trackers (`MetricsWriter.record_checkpoint`)."""
    record = getattr(writer, "record_checkpoint", None)
    if record is not None:
        record(step, os.path.join(manager.directory, str(step)))


def checkpoint_hook(
    manager: Optional[CheckpointManager],
    batches: Any,
    *,
    cfg: Any,
    writer: Any = None,
    model_info: Optional[Mapping[str, Any]] = None,
    sharding: Any = None,
) -> Optional[Callable[[int, Any], None]]:
    """`on_step_end(step, state)` for `train_loop`: saves due steps with the metrics logged at them."""
    if manager is None:
        return None

    def on_step_end(step: int, state: Any) -> None:
        if save_if_due(manager, step, state, batches, cfg=cfg, metrics=_metrics_at(writer, step),
                       model_info=model_info, sharding=sharding):
            _record_checkpoint(writer, manager, step)

    return on_step_end


def finish(
    manager: Optional[CheckpointManager],
    state: Any,
    batches: Any,
    *,
    cfg: Any,
    writer: Any = None,
    model_info: Optional[Mapping[str, Any]] = None,
    sharding: Any = None,
) -> Optional[int]:
    """Save the final step (if not saved yet), wait for every write, close; the last saved step."""
    if manager is None:
        return None
    try:
        step = int(state.step)  # host sync: once, at the end
        saved = save_if_due(manager, step, state, batches, cfg=cfg, metrics=_metrics_at(writer, step),
                            model_info=model_info, sharding=sharding, force=True)
        manager.wait()
        if saved:
            _record_checkpoint(writer, manager, step)
        return manager.latest_step()
    finally:
        manager.close()
