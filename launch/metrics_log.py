"""Writing metrics: one JSON object per logged step, TensorBoard events, and a loss plot; with `trackers=`,
the same rows (and each saved checkpoint) go to W&B / MLflow too (`ember.launch.trackers`).

Public names: `MetricsWriter`, `read_metrics`, `plot_losses`, `host_values`.

Steps return metrics as 0-d device tensors; the writer is the one place they cross to the host,
all at once per logged step (`torch.stack(...).tolist()`), so a step never syncs.

`metrics.jsonl` is strict JSON: a NaN or infinite value (a diverged run) is written as `null`, which
every JSON reader accepts, and `read_metrics` gives it back as NaN.

Example:
    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> with MetricsWriter(d, tensorboard=False) as w:
    ...     _ = w.write(0, {"loss": torch.tensor(2.5)})
    >>> read_metrics(d)
    [{'step': 0, 'loss': 2.5}]
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["MetricsWriter", "host_values", "plot_losses", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
_MARKED_POINTS = 30  # a loss line with at most this many points also marks each one


def host_values(metrics: Mapping[str, Any]) -> Dict[str, float]:
    """`metrics` as Python floats: every 0-d tensor crosses to the host in one transfer (one sync)."""
    names = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if names:
        stacked = torch.stack([metrics[k].detach().float().reshape(()).cpu() for k in names])
        out.update(zip(names, stacked.tolist()))  # host sync: the one per logged step
    return out


class MetricsWriter:
    """Appends metrics to `<out>/metrics.jsonl` and TensorBoard; without `out`, keeps them in memory.

    Args:
        out: the run directory, or None to only keep `history`.
        tensorboard: also write TensorBoard event files under `out`.
        append: keep the rows already in `metrics.jsonl` (a resumed run); otherwise start it afresh.
        up_to_step: with `append`, keep only the rows up to this step (the step a run resumes
            from): the steps after it run again, so each step keeps one row.
        trackers: experiment trackers (`ember.launch.trackers.open_trackers`) that get every row written
            here, and the checkpoints `record_checkpoint` names; closed by `close`.
    """

    def __init__(self, out: Optional[str | os.PathLike], *, tensorboard: bool = True, append: bool = False,
                 up_to_step: Optional[int] = None, trackers: Sequence[Any] = ()) -> None:
        self.out = None if out is None else os.fspath(out)
        self.history: List[Dict[str, float]] = []
        self.trackers = list(trackers)
        self._checkpoints: List[Tuple[int, str]] = []  # saved, not yet recorded (an async save still writing)
        self._file = None
        self._tb = None
        if self.out is not None:
            os.makedirs(self.out, exist_ok=True)
            path = os.path.join(self.out, METRICS_FILE)
            if append and up_to_step is not None and os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= up_to_step]
                with open(path, "w") as f:
                    f.writelines(kept)
            self._file = open(path, "a" if append else "w", buffering=1)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=self.out)

    def write(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> Dict[str, float]:
        """Log `metrics` (0-d tensors or numbers) at `step`; `prefix` names a split ("eval_")."""
        row = {"step": int(step), **{prefix + k: v for k, v in host_values(metrics).items()}}
        self.history.append(row)
        if self._file is not None:
            strict = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}
            self._file.write(json.dumps(strict, allow_nan=False) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and math.isfinite(v):
                    self._tb.add_scalar(k, v, global_step=row["step"])
        for tracker in self.trackers:
            tracker.log(row["step"], {k: v for k, v in row.items() if k != "step"})
        if self._checkpoints:
            self._record_checkpoints()
        return row

    def record_checkpoint(self, step: int, path: str | os.PathLike) -> None:
        """Record the checkpoint folder `path` of `step` in the trackers, once it exists (an async save
        renames it into place when done: it is recorded at a later `write` or at `close`)."""
        if self.trackers:
            self._checkpoints.append((int(step), os.fspath(path)))
            self._record_checkpoints()

    def _record_checkpoints(self) -> None:
        waiting = []
        for step, path in self._checkpoints:
            if not os.path.isdir(path):
                waiting.append((step, path))
                continue
            for tracker in self.trackers:
                tracker.log_artifact(path, kind="checkpoint", step=step)
        self._checkpoints = waiting

    def close(self) -> None:
        """Flush and close the files and the trackers (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        try:
            if self._checkpoints:
                self._record_checkpoints()  # the last saves were waited for (checkpointing.finish)
        finally:
            trackers, self.trackers, self._checkpoints = self.trackers, [], []
            for tracker in trackers:
                tracker.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(out: str | os.PathLike) -> List[Dict[str, float]]:
    """The rows of `<out>/metrics.jsonl` (`null` values, written for NaN and infinities, read as NaN)."""
    with open(os.path.join(os.fspath(out), METRICS_FILE)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{k: math.nan if v is None else v for k, v in row.items()} for row in rows]


def plot_losses(rows: List[Mapping[str, float]], path: str | os.PathLike, *, title: str = "") -> None:
    """Write a PNG of `loss` and `eval_loss` against step, under `title` (the run and model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("loss", "-"), ("eval_loss", "o-")):
        pts = [(r["step"], r[name]) for r in rows if name in r]
        if pts:  # few points get markers: one point drawn as a line alone would not show
            ax.plot(*zip(*pts), "o-" if len(pts) <= _MARKED_POINTS else style, label=name, markersize=4)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)
