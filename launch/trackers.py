"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow.

Public names: `LogConfig`, `Tracker`, `WandbTracker`, `MLflowTracker`, `check_trackers`, `open_trackers`,
`record_export`.

    python launch/train.py --out runs/a --log.wandb my-project           # WANDB_MODE=offline: no network
    python launch/train.py --out runs/a --log.mlflow file:./mlruns       # `mlflow ui --backend-store-uri ./mlruns`

`MetricsWriter(out, trackers=open_trackers(cfg, out, resumed=...))` sends every row it writes to
`metrics.jsonl` to each tracker too, under the same names and steps. The trackers' run ids are kept in
`OUT/trackers.json`, so `--resume` continues the same W&B and MLflow runs, and `launch/ckpt.py export`
records the exported model in them. A resumed run trains the steps after its checkpoint again:
metrics.jsonl keeps one row per step (the re-run's), MLflow keeps both values of such a step (the later
one is the re-run's, as in metrics.jsonl), and W&B, whose steps only go forward, drops the re-run's rows
for steps it already holds (it shows the stopped run's values there). Checkpoints are recorded as
references to their folders, never copied: a W&B `model` artifact per save, an MLflow tag per save.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Mapping, Optional

__all__ = ["LogConfig", "MLflowTracker", "Tracker", "WandbTracker", "check_trackers", "open_trackers",
           "record_export"]

TRACKERS_FILE = "trackers.json"  # in the run directory: each tracker's run id, for --resume and exports
_MLFLOW_PARAM_LENGTH = 500  # MLflow's oldest servers' limit for a param value (newer accept 6000)
_MLFLOW_BATCH = 100  # params per MLflow log_batch call (its limit)


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Where a run's metrics go besides `metrics.jsonl` and TensorBoard (`--log.wandb PROJECT`, `--log.mlflow URI`)."""

    wandb: Optional[str] = None
    """Weights & Biases project (offline under WANDB_MODE=offline); needs `pip install "ember[wandb]"`."""
    mlflow: Optional[str] = None
    """MLflow tracking URI, e.g. file:./mlruns; needs `pip install "ember[mlflow]"`."""


def check_trackers(log: LogConfig) -> None:
    """Raise a one-line ValueError when a tracker `log` names is not installed (call before any file is written)."""
    for flag, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if getattr(log, flag):
            try:
                __import__(module)
            except ImportError:
                raise ValueError(f"--log.{flag} needs {module}, which is not installed here; "
                                 f'pip install "ember[{flag}]"') from None


class Tracker:
    """One run in an experiment tracker: rows of metrics at steps, the run config, artifacts."""

    name = "tracker"

    def log(self, step: int, row: Mapping[str, float]) -> None:
        """Record `row` (metric name -> value, as in metrics.jsonl) at `step`."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run config (`ember.core.dataclass_json.to_dict` of it)."""

    def log_artifact(self, path: str, *, kind: str, step: Optional[int] = None) -> None:
        """Record the file or folder `path`: `kind` "checkpoint" (referenced) or "export" (what users ship)."""

    def ids(self) -> Dict[str, Any]:
        """What reopens this run (saved in `OUT/trackers.json`)."""
        return {}

    def close(self) -> None:
        """Finish the run (idempotent)."""


def _flat(config: Mapping[str, Any], prefix: str = "") -> Dict[str, str]:
    """`{"data.seq_len": "64", ...}`: nested dicts as dotted keys, `__type__` dropped, values as strings."""
    out: Dict[str, str] = {}
    for k, v in config.items():
        if k == "__type__":
            continue
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            text = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
            out[prefix + k] = text if len(text) <= _MLFLOW_PARAM_LENGTH else text[:_MLFLOW_PARAM_LENGTH - 3] + "..."
    return out


def _plain(config: Any) -> Any:
    """`config` without the `__type__` entries `to_dict` records."""
    if isinstance(config, Mapping):
        return {k: _plain(v) for k, v in config.items() if k != "__type__"}
    return config


def _wandb_dir(out: str) -> str:
    return os.environ.get("WANDB_DIR") or out  # WANDB_DIR, when set, wins (read here: wandb reads it once a process)


def _artifact_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


class WandbTracker(Tracker):
    """A Weights & Biases run (`wandb.init(project=..., id=..., resume="allow")`); offline under WANDB_MODE=offline.

    Args:
        project: the W&B project.
        out: the run directory (W&B's files go to `OUT/wandb` unless WANDB_DIR is set).
        run_id: the run to continue (from `trackers.json`); None starts a new one.
        config: the run config, recorded as the W&B config.
    """

    name = "wandb"

    def __init__(self, project: str, out: str, *, run_id: Optional[str] = None,
                 config: Optional[Mapping[str, Any]] = None) -> None:
        import wandb

        self._wandb = wandb
        self.project = project
        quiet = wandb.Settings(silent=os.environ.get("WANDB_SILENT", "true").lower() in ("1", "true"),
                               console=os.environ.get("WANDB_CONSOLE", "off"))  # unless set: no banner, no capture
        self.run = wandb.init(project=project, dir=_wandb_dir(out), id=run_id, resume="allow",
                              name=os.path.basename(os.path.abspath(out)), settings=quiet)
        if config is not None:
            self.log_config(config)

    def log(self, step: int, row: Mapping[str, float]) -> None:
        self.run.log(dict(row), step=step)  # W&B drops a step lower than one it already holds

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(_plain(config), allow_val_change=True)

    def log_artifact(self, path: str, *, kind: str, step: Optional[int] = None) -> None:
        artifact = self._wandb.Artifact(_artifact_name(f"{self.run.id}-{kind}"), type="model",
                                        metadata={"path": os.path.abspath(path), "step": step})
        artifact.add_reference("file://" + os.path.abspath(path), checksum=False)  # a reference: nothing copied
        aliases = ["latest"] + ([f"step-{step}"] if step is not None else [])
        self.run.log_artifact(artifact, aliases=aliases)

    def ids(self) -> Dict[str, Any]:
        return {"project": self.project, "id": self.run.id}

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MLflowTracker(Tracker):
    """An MLflow run in the experiment `MLFLOW_EXPERIMENT_NAME` (default "ember") of `tracking_uri`.

    Args:
        tracking_uri: e.g. `file:./mlruns` or `http://host:5000`.
        out: the run directory (its name is the MLflow run name).
        run_id: the run to continue (from `trackers.json`); None starts a new one.
        config: the run config: flattened to params (`data.seq_len`), and whole as the artifact `config.json`.
    """

    name = "mlflow"

    def __init__(self, tracking_uri: str, out: str, *, run_id: Optional[str] = None,
                 config: Optional[Mapping[str, Any]] = None) -> None:
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        if tracking_uri.startswith("file:"):  # MLflow 3 opts into its file store by this variable; the URI asked for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri)
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ember")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(out))).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        if config is not None:
            self.log_config(config)

    def log(self, step: int, row: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.time import get_current_time_millis

        now = get_current_time_millis()
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in row.items()])

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Params as first logged stay (MLflow refuses to change one): a resumed run adds new keys only;
        `config.json` (an artifact) is always the latest config."""
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in _flat(config).items() if k not in have]
        for i in range(0, len(new), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + _MLFLOW_BATCH])
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def log_artifact(self, path: str, *, kind: str, step: Optional[int] = None) -> None:
        path = os.path.abspath(path)
        self.client.set_tag(self.run_id, f"ember.{kind}" + (f".{step}" if step is not None else ""), path)
        if kind == "export":  # exports are what users ship: copied into the run's artifacts
            if os.path.isdir(path):
                self.client.log_artifacts(self.run_id, path, artifact_path=f"export/{os.path.basename(path)}")
            else:
                self.client.log_artifact(self.run_id, path, artifact_path="export")

    def ids(self) -> Dict[str, Any]:
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id}

    def close(self) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id)
            self.client = None


def _absolute_store(uri: str) -> str:
    """`file:./mlruns` (or `./mlruns`) as an absolute `file:` URI: a resume or an export from another folder
    finds the same store."""
    if not uri.startswith("file:") and (":" in uri or uri.startswith("databricks") or uri == "uc"):
        return uri  # a server, a database, Databricks
    path = uri[len("file://"):] if uri.startswith("file://") else uri[len("file:"):] if uri.startswith("file:") else uri
    return "file:" + os.path.abspath(path)


def _read_ids(out: str) -> Dict[str, Any]:
    path = os.path.join(out, TRACKERS_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def open_trackers(cfg: Any, out: Optional[str], *, resumed: bool) -> List[Tracker]:
    """The trackers `cfg.log` asks for, writing their run ids to `OUT/trackers.json` (none without `out`).

    A `resumed` run reopens the runs named in `trackers.json` (the same W&B id, the same MLflow run);
    a new run starts new ones. Call on the rank that writes files only.
    """
    log = getattr(cfg, "log", None)
    if out is None or log is None or not (log.wandb or log.mlflow):
        return []
    from ember.core.dataclass_json import to_dict

    check_trackers(log)
    config, ids = to_dict(cfg), _read_ids(out) if resumed else {}
    trackers: List[Tracker] = []
    try:
        if log.wandb:
            same = ids.get("wandb", {}).get("project") == log.wandb
            trackers.append(WandbTracker(log.wandb, out, run_id=ids["wandb"]["id"] if same else None, config=config))
        if log.mlflow:
            from mlflow.exceptions import MlflowException

            uri = _absolute_store(log.mlflow)
            same = ids.get("mlflow", {}).get("tracking_uri") == uri
            try:
                trackers.append(MLflowTracker(uri, out, run_id=ids["mlflow"]["run_id"] if same else None,
                                              config=config))
            except MlflowException as error:  # e.g. MLflow 3's refusal of a file store: its message says the fix
                raise ValueError(f"--log.mlflow {log.mlflow}: {error.message}") from error
    except BaseException:
        for t in trackers:
            t.close()
        raise
    with open(os.path.join(out, TRACKERS_FILE), "w") as f:
        json.dump({**ids, **{t.name: t.ids() for t in trackers}}, f, indent=2)
    return trackers


def record_export(directory: str, path: str, *, say=lambda m: print(m, file=sys.stderr)) -> List[str]:
    """Record the export `path` of the run `directory` (or its `checkpoints/`) in the trackers of its
    `trackers.json`; the names of the trackers it reached. A tracker not installed or not reachable here is
    said on stderr, and skipped."""
    run = os.path.abspath(directory)
    if not os.path.exists(os.path.join(run, TRACKERS_FILE)) and os.path.basename(run) == "checkpoints":
        run = os.path.dirname(run)
    ids, done = _read_ids(run), []
    for name, make in (("wandb", lambda i: WandbTracker(i["project"], run, run_id=i["id"])),
                       ("mlflow", lambda i: MLflowTracker(i["tracking_uri"], run, run_id=i["run_id"]))):
        if name not in ids:
            continue
        try:
            __import__(name)
        except ImportError:
            say(f"note: {path} not recorded in the run's {name} run: {name} is not installed here")
            continue
        try:  # the export is written: a tracker that cannot be reached (no login, no server) is said, not raised
            tracker = make(ids[name])
            try:
                tracker.log_artifact(path, kind="export")
            finally:
                tracker.close()
        except Exception as error:
            say(f"note: {path} not recorded in the run's {name} run: {type(error).__name__}: {error}")
            continue
        done.append(name)
    return done

