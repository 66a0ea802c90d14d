"""Experiment trackers (issue 62): W&B (offline) and MLflow (a file store) get the rows of metrics.jsonl,
the run config, checkpoints and exports; `--resume` continues the same tracker runs; a tracker that is
not installed is refused in one line before anything is written."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from ember.launch import ckpt, train
from ember.launch.metrics_log import MetricsWriter, read_metrics
from ember.launch.trackers import TRACKERS_FILE, Tracker, _flat

TINY = ["--backend", "eager", "--data.max_bytes", "100000", "--data.batch_size", "2", "--data.seq_len", "32",
        "--model.n_layers", "1", "--log_every", "1", "--eval_every", "2", "--eval_batches", "1", "--sample_tokens", "0"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def trackers_env(tmp_path, monkeypatch):
    """W&B offline into tmp_path/wandb, quiet; MLflow into a file store under tmp_path."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    (tmp_path / "wandb").mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "ember-test")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # a file: URI opts into MLflow 3's file store itself
    yield ["--log.wandb", "ember-test", "--log.mlflow", f"file:{tmp_path / 'mlruns'}"]
    import wandb

    wandb.teardown()  # wandb keeps one setup (its environment read once) per process


class Recording(Tracker):
    def __init__(self):
        self.calls = []

    def log(self, step, row):
        self.calls.append(("log", step, dict(row)))

    def log_artifact(self, path, *, kind, step=None):
        self.calls.append((kind, step, path))

    def close(self):
        self.calls.append(("close",))


def test_the_writer_sends_each_row_and_each_saved_checkpoint_to_its_trackers(tmp_path):
    import torch

    tracker = Recording()
    writer = MetricsWriter(tmp_path, tensorboard=False, trackers=[tracker])
    writer.write(2, {"loss": torch.tensor(1.5)})
    writer.write(2, {"loss": torch.tensor(1.25)}, prefix="eval_")
    writer.record_checkpoint(2, tmp_path / "checkpoints" / "2")  # an async save: its folder is not there yet
    writer.write(3, {"loss": 1.0})
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    writer.close()
    writer.close()  # idempotent: the trackers close once
    assert tracker.calls == [("log", 2, {"loss": 1.5}), ("log", 2, {"eval_loss": 1.25}), ("log", 3, {"loss": 1.0}),
                             ("checkpoint", 2, str(tmp_path / "checkpoints" / "2")), ("close",)]


def test_mlflow_params_are_the_flattened_config_cut_to_mlflows_length():
    flat = _flat({"__type__": "TrainConfig", "steps": 4, "data": {"__type__": "DataConfig", "seq_len": 32},
                  "lora": {"targets": ["wq", "wv"]}, "sample_prompt": "x" * 900, "init_from": None})
    assert flat == {"steps": "4", "data.seq_len": "32", "lora.targets": '["wq", "wv"]',
                    "sample_prompt": "x" * 497 + "...", "init_from": "None"}


def _wandb_records(path):
    """The records of an offline W&B run file (`run-<id>.wandb`): a 7-byte header, then leveldb-style
    32 KiB blocks of records, each `crc32, length (u16), type (u8)` and a piece of a `Record` proto."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or the LAST piece of one record
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _wandb_runs(wandb_dir):
    """{run file: (run id, history {step: {metric: value}}, config {key: value}, [artifact manifests refs])}."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        run_id, history, config, artifacts = None, {}, {}, []
        for r in _wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
                config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                row = {(u.key or "/".join(u.nested_key)): json.loads(u.value_json) for u in r.history.item}
                history.setdefault(int(row.pop("_step")), {}).update(
                    {k: v for k, v in row.items() if not k.startswith("_")})
            elif kind == "artifact":
                artifacts.append((r.artifact.name, r.artifact.type, [m.ref for m in r.artifact.manifest.contents]))
        runs[path] = (run_id, history, config, artifacts)
    return runs


def _jsonl_by_step(out):
    """metrics.jsonl as {step: {metric: value}} (the last value of each metric at each step)."""
    by_step = {}
    for row in read_metrics(out):
        by_step.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step"})
    return by_step


def _mlflow_by_step(out):
    """The run's MLflow metric history as {step: {metric: value}}: the last value logged at each step."""
    from mlflow.tracking import MlflowClient

    ids = json.load(open(out / TRACKERS_FILE))["mlflow"]
    client = MlflowClient(ids["tracking_uri"])
    run = client.get_run(ids["run_id"])
    by_step, counts = {}, {}
    for key in run.data.metrics:
        for m in sorted(client.get_metric_history(ids["run_id"], key), key=lambda m: (m.step, m.timestamp)):
            by_step.setdefault(m.step, {})[key] = m.value
            counts[(key, m.step)] = counts.get((key, m.step), 0) + 1
    return run, by_step, counts


def test_a_run_logs_the_rows_of_metrics_jsonl_to_wandb_and_mlflow(tmp_path, trackers_env):
    out = tmp_path / "run"
    train.main([*TINY, "--steps", "4", "--checkpoint_every", "2", "--out", str(out), *trackers_env])
    expected = _jsonl_by_step(out)
    assert {"loss", "eval_loss"} <= set(expected[4]) and 0 in expected  # train rows and eval rows, step 0's eval
    run, mlflow_rows, counts = _mlflow_by_step(out)
    assert mlflow_rows == expected and set(counts.values()) == {1}
    assert run.data.params["steps"] == "4" and run.data.params["data.seq_len"] == "32"
    assert run.data.params["model.n_layers"] == "1" and run.info.status == "FINISHED"
    ckpts = {k: v for k, v in run.data.tags.items() if k.startswith("ember.checkpoint.")}
    assert ckpts == {f"ember.checkpoint.{s}": str(out / "checkpoints" / str(s)) for s in (2, 4)}
    (path, (run_id, history, config, artifacts)), = _wandb_runs(tmp_path / "wandb").items()
    assert run_id == json.load(open(out / TRACKERS_FILE))["wandb"]["id"]
    assert history == expected  # step for step, train and eval_ metrics under the same names
    assert config["steps"] == 4 and config["data"]["seq_len"] == 32 and config["model"]["n_layers"] == 1
    refs = {a[0]: a[2] for a in artifacts}
    assert all(t == "model" for _, t, _ in artifacts) and len(artifacts) == 2  # one per checkpoint save
    assert all(ref.startswith(f"file://{out}/checkpoints/") for r in refs.values() for ref in r)


def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path, trackers_env, capsys):
    import shutil

    out = tmp_path / "run"
    argv = [*TINY, "--steps", "6", "--checkpoint_every", "3", "--keep", "0", "--out", str(out), *trackers_env]
    train.main(argv)
    ids = json.load(open(out / TRACKERS_FILE))
    shutil.rmtree(out / "checkpoints" / "6")  # as if stopped before the last checkpoint: steps 4-6 run again
    train.main([*argv, "--resume"])
    assert "resumed from step 3" in capsys.readouterr().out
    assert json.load(open(out / TRACKERS_FILE)) == ids  # the same W&B id, the same MLflow run
    expected = _jsonl_by_step(out)
    run, mlflow_rows, counts = _mlflow_by_step(out)
    assert set(mlflow_rows) == set(expected)
    for step, row in expected.items():  # the last value of each step is the re-run's, as in metrics.jsonl
        assert {k: mlflow_rows[step][k] for k in row} == row, step
        stale = set(mlflow_rows[step]) - set(row)  # MLflow deletes no value: the stopped run's timings of step 4
        assert not stale or step == 4 and all(k.startswith(("time/", "throughput/")) for k in stale), (step, stale)
    assert counts[("loss", 5)] == 2 and counts[("loss", 2)] == 1  # MLflow keeps both values of a re-run step
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.status == "FINISHED"
    runs = list(_wandb_runs(tmp_path / "wandb").values())
    assert [r[0] for r in runs] == [ids["wandb"]["id"]] * 2  # two offline sessions of one W&B run
    assert {s: runs[1][1][s] for s in (4, 5, 6)} == {s: expected[s] for s in (4, 5, 6)}


def test_export_is_recorded_in_the_runs_trackers(tmp_path, trackers_env, capsys):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    train.main([*TINY, "--steps", "1", "--eval_every", "0", "--checkpoint_every", "0", "--out", str(out),
                *trackers_env])
    exported = tmp_path / "model.safetensors"
    ckpt.main(["export", str(out), "--out", str(exported)])
    assert f"recorded {exported} in the run's wandb and mlflow run" in capsys.readouterr().out
    ids = json.load(open(out / TRACKERS_FILE))
    client = MlflowClient(ids["mlflow"]["tracking_uri"])
    assert client.get_run(ids["mlflow"]["run_id"]).data.tags["ember.export"] == str(exported)
    assert [a.path for a in client.list_artifacts(ids["mlflow"]["run_id"], "export")] == ["export/model.safetensors"]
    runs = list(_wandb_runs(tmp_path / "wandb").values())
    assert [r[0] for r in runs] == [ids["wandb"]["id"]] * 2
    assert runs[1][3] == [(f"{ids['wandb']['id']}-export", "model", [f"file://{exported}"])]


BLOCK = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None  # `import name` raises ImportError\n"


@pytest.mark.parametrize("flag,module", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_tracker_not_installed_is_one_line_before_anything_is_written(tmp_path, flag, module):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK.format(names=[module]))
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    value = "p" if flag == "wandb" else f"file:{tmp_path / 'mlruns'}"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "train.py"), *TINY, "--steps", "1",
                           "--out", str(out), f"--log.{flag}", value], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f'error: --log.{flag} needs {module}, which is not installed here; pip install "ember[{flag}]" '
        f"(EMBER_DEBUG=1 shows the traceback)"]
    assert not out.exists() and not (tmp_path / "mlruns").exists()


@pytest.mark.xla
def test_a_tpu_pod_run_logs_its_losses_and_checkpoints(tmp_path, monkeypatch):
    import importlib.util
    import re

    from mlflow.tracking import MlflowClient

    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla], or make install)")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out, uri = tmp_path / "run", f"file:{tmp_path / 'mlruns'}"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "tpu_pod.py"), "--mesh", "dp=2", "--steps",
                           "2", "--data.batch_size", "4", "--data.seq_len", "32", "--data.max_bytes", "100000",
                           "--model.n_layers", "1", "--no-check", "--out", str(out), "--log.mlflow", uri],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = {int(s): float(v) for s, v in re.findall(r"^step (\d+): loss ([\d.]+)", proc.stdout, re.M)}
    ids = json.load(open(out / TRACKERS_FILE))["mlflow"]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store the run wrote
    client = MlflowClient(uri)
    logged = {m.step: m.value for m in client.get_metric_history(ids["run_id"], "loss")}
    assert sorted(logged) == [1, 2] and all(abs(logged[s] - printed[s]) < 1e-6 for s in printed), (logged, printed)
    assert client.get_run(ids["run_id"]).data.tags["ember.checkpoint.2"] == str(out / "checkpoints" / "2")
