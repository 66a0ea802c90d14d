"""launch/ckpt.py (list, export to safetensors / Hugging Face) and ember.launch.checkpointing (the
functions train.py calls: build the manager from a TrainConfig, resume, save on schedule, finish)."""

import dataclasses
import io
from typing import Optional

import pytest
import torch

from ember import data, optim
from ember.core import TrainState, random
from ember.core.checkpoint import CheckpointError, CheckpointManager
from ember.data.config import DataConfig
from ember.launch.run_config import TrainConfig
from ember.optim.config import OptimConfig
from ember.core.jit import jit
from ember.launch.metrics_log import MetricsWriter
from ember.core.pytree import tree_leaves_with_path
from ember.core.step_fns import train_step
from ember.launch import checkpointing as C
from ember.launch import ckpt as cli
from ember.launch.loop import train_loop
from ember.models import build_model, get_config, lm_loss



@dataclasses.dataclass(frozen=True)
class CkptConfig(TrainConfig):
    """TrainConfig plus the checkpoint fields ember.launch.checkpointing reads."""

    checkpoint_every: int = 2
    keep: int = 2
    keep_best: Optional[str] = None


def _cfg(out, **kw):
    model = get_config("llama3", "tiny").replace(vocab_size=320, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                                 ffn_dim=64, max_seq_len=32)
    kw = {"steps": 6, **kw}
    return CkptConfig(family="llama3", model=model, optim=OptimConfig(warmup_steps=1),
                      data=DataConfig(max_bytes=30_000, seq_len=16, batch_size=4), backend="eager",
                      log_every=1, out=str(out), **kw)


def _train(cfg, *, resume, stop_at=None, log=print):
    """What train.py does around train_loop, with the checkpoint functions wired in; `stop_at`
    ends the process early (the schedule still spans `cfg.steps`)."""
    model = build_model(cfg.family, cfg.model)
    tokenizer = data.build_tokenizer(cfg.data)
    tx = optim.from_config(cfg.optim, total_steps=cfg.steps)
    state = TrainState.create(params=model.init(random.key(cfg.seed)), tx=tx, key=random.key(1))
    batches = data.build_batches(cfg.data, tokenizer=tokenizer)
    ckpt = C.build_manager(cfg)
    info = C.model_info_for(cfg, arch="test_tiny")
    state = C.maybe_resume(ckpt, state, batches, cfg=cfg, resume=resume, model_info=info, log=log)
    writer = MetricsWriter(None)
    step = jit(train_step(lm_loss(model)), backend="eager", donate="state")
    state = train_loop(step, state, batches, steps=stop_at or cfg.steps, writer=writer, log_every=1, progress=False,
                       on_step_end=C.checkpoint_hook(ckpt, batches, cfg=cfg, writer=writer, model_info=info))
    C.finish(ckpt, state, batches, cfg=cfg, writer=writer, model_info=info)
    return state, [r["loss"] for r in writer.history]


def test_train_stop_resume_matches_a_straight_run(tmp_path):
    straight, losses = _train(_cfg(tmp_path / "a"), resume=False)
    _train(_cfg(tmp_path / "b"), resume=False, stop_at=4)
    messages = []
    resumed, tail = _train(_cfg(tmp_path / "b"), resume=True, log=messages.append)
    assert messages and messages[0].startswith("resumed from step 4 of ")
    assert tail == losses[4:]
    for (path, x), (_, y) in zip(tree_leaves_with_path(resumed), tree_leaves_with_path(straight)):
        assert torch.equal(x, y), path
    with CheckpointManager(tmp_path / "b" / "checkpoints", read_only=True) as ckpt:
        assert ckpt.all_steps() == [4, 6]  # keep=2
        meta = ckpt.read_meta(6)
    assert meta.model["arch"] == "test_tiny" and meta.config["checkpoint_every"] == 2 and "loss" in meta.metrics


def test_resume_without_a_checkpoint_starts_fresh_and_without_out_is_an_error(tmp_path):
    cfg = _cfg(tmp_path / "fresh")
    messages = []
    manager = C.build_manager(cfg)
    state = {"step": torch.tensor(0)}
    assert C.maybe_resume(manager, state, None, cfg=cfg, resume=True, log=messages.append) is state
    assert "no checkpoint" in messages[0]
    manager.close()
    off = dataclasses.replace(cfg, out=None)
    assert C.build_manager(off) is None and C.build_manager(dataclasses.replace(cfg, checkpoint_every=-1)) is None
    with pytest.raises(ValueError, match="--resume needs checkpoints, but this run has none"):
        C.maybe_resume(None, state, None, cfg=off, resume=True)


def test_keep_best_from_the_config(tmp_path):
    cfg = _cfg(tmp_path, keep=1, keep_best="eval_loss", checkpoint_every=1, eval_every=1)
    ckpt = C.build_manager(cfg)
    for step, loss in [(1, 2.0), (2, 1.0), (3, 3.0)]:
        assert C.save_if_due(ckpt, step, {"params": {"w": torch.ones(1)}}, _NoData(), cfg=cfg, metrics={"eval_loss": loss})
    assert not C.save_if_due(ckpt, 3, {"params": {"w": torch.ones(1)}}, _NoData(), cfg=cfg)  # already saved
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.best_step() == 2
    ckpt.close()


class _NoData:
    def get_state(self):
        return {"next_batch": 0, "config": {}}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = _cfg(out, steps=2)
    state, _ = _train(cfg, resume=False)
    return out / "checkpoints", state, cfg


def test_list_shows_steps_model_params_and_metrics(saved_run):
    directory, state, _ = saved_run
    buf = io.StringIO()
    assert cli.list_checkpoints(str(directory), out=buf) == {2: []}
    text = buf.getvalue()
    assert "every array checked against its CRC-32" in text and "DAMAGED" not in text
    n_params = sum(x.numel() for _, x in tree_leaves_with_path(state.params))
    assert "1 checkpoints in" in text and "llama3/test_tiny" in text and f"{n_params:,}" in text
    assert "loss=" in text and "grad_norm=" in text


def test_export_safetensors_holds_the_params(saved_run, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    directory, state, _ = saved_run
    out = tmp_path / "model.safetensors"
    cli.main(["export", str(directory), "--out", str(out)])
    loaded = load_file(str(out))
    expected = dict(tree_leaves_with_path(state.params))
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["step"] == "2"


def test_export_hf_round_trips_through_from_hf(saved_run, tmp_path):
    from ember.models import from_hf

    directory, state, cfg = saved_run
    cli.main(["export", str(directory), "--step", "2", "--hf", "--out", str(tmp_path / "hf")])
    model, params = from_hf(str(tmp_path / "hf"))
    assert model.config.d_model == cfg.model.d_model
    for (path, x), (_, y) in zip(tree_leaves_with_path(params), tree_leaves_with_path(state.params)):
        assert torch.equal(x, y), path


def test_cli_errors_name_the_problem(saved_run, tmp_path):
    directory, _, _ = saved_run
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 9 .*saved steps: 2"):
        cli.main(["export", str(directory), "--step", "9", "--out", str(tmp_path / "x.safetensors")])
    with pytest.raises(CheckpointError, match=r"does not exist"):
        cli.main(["list", str(tmp_path / "missing")])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(CheckpointError, match=r"run directory without checkpoints \(it contains metrics.jsonl\): "
                                              r"the run saved none. Train it with `--checkpoint_every N`"):
        cli.main(["list", str(tmp_path / "run")])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holds no checkpoints and no checkpoints/ folder \(it contains a.txt\)"
                                              r"\. Pass a run directory \(the --out of launch/train.py\)"):
        cli.main(["export", str(tmp_path / "notes"), "--out", str(tmp_path / "x.safetensors")])
    with pytest.raises(CheckpointError, match=r"is one saved step, not a checkpoint directory; pass its parent"):
        cli.main(["list", str(directory / "2")])
    assert not (tmp_path / "x.safetensors").exists()


def test_list_and_export_take_the_run_directory(saved_run, tmp_path, capsys):
    directory, state, _ = saved_run
    run = directory.parent  # the run's --out: checkpoints/, metrics.jsonl, ...
    assert cli.main(["list", str(run)]) == 0
    assert f"1 checkpoints in {directory} (every array" in capsys.readouterr().out
    out = tmp_path / "model.safetensors"
    cli.main(["export", str(run), "--out", str(out)])
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out))["wte.weight"], state.params["wte"]["weight"])


def test_exported_files_take_the_umask(saved_run, tmp_path):
    """safetensors writes a temporary file (mode 0600) and renames it; export sets the umask's mode."""
    import os

    directory, _, _ = saved_run
    for umask, mode in [(0o022, 0o644), (0o027, 0o640)]:
        old = os.umask(umask)
        try:
            cli.main(["export", str(directory), "--out", str(tmp_path / f"{umask:o}.safetensors")])
            cli.main(["export", str(directory), "--hf", "--out", str(tmp_path / f"hf{umask:o}")])
        finally:
            os.umask(old)
        for path in (tmp_path / f"{umask:o}.safetensors", tmp_path / f"hf{umask:o}" / "model.safetensors",
                     tmp_path / f"hf{umask:o}" / "config.json"):
            assert oct(path.stat().st_mode & 0o777) == oct(mode), path


def test_export_logs_no_orbax_warning_about_the_data_item(saved_run, tmp_path, caplog):
    import logging

    directory, _, _ = saved_run
    with caplog.at_level(logging.INFO, logger="absl"):
        cli.main(["export", str(directory), "--out", str(tmp_path / "m.safetensors")])
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _flip_bytes(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 40):
        data[i] ^= 0x55
    path.write_bytes(bytes(data))


@pytest.fixture
def damaged_run(tmp_path):
    """A run directory with steps 1-4: step 2 lost its metadata (half-pruned), step 4's arrays were hit."""
    import shutil

    run = tmp_path / "run"
    state = {"params": {"w": torch.randn(64, 64), "b": torch.zeros(64)}, "mu": torch.ones(64, 64)}
    with CheckpointManager(run / C.CHECKPOINTS_DIR) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state, metrics={"loss": 1.0 / step}, data_state={"next_batch": step})
    shutil.rmtree(run / C.CHECKPOINTS_DIR / "2" / "meta")
    arrays = [p for p in (run / C.CHECKPOINTS_DIR / "4").rglob("*") if p.is_file() and p.parent.name == "d"]
    _flip_bytes(max(arrays, key=lambda p: p.stat().st_size))
    return run


def test_list_marks_damaged_steps_and_names_the_step_to_resume(damaged_run, capsys):
    assert cli.main(["list", str(damaged_run)]) == 1
    lines = capsys.readouterr().out.splitlines()
    rows = {int(line.split()[0]): line for line in lines[2:6]}
    assert "DAMAGED" not in rows[1] + rows[3] and "loss=0.3333" in rows[3]
    assert rows[2].endswith("DAMAGED: no `meta` item (pruned or written half-way)")
    assert "loss=0.25  DAMAGED: CRC-32 mismatch in 1 of " in rows[4]
    assert lines[6] == (f"2 damaged steps (2, 4); restore step 3, the newest intact one, with `python launch/train.py "
                        f"--out {damaged_run} --resume --resume_step 3` (export: --step 3).")
    assert cli.main(["list", str(damaged_run), "--no-verify"]) == 1  # metadata only: step 4 reads as intact
    text = capsys.readouterr().out
    assert "metadata only" in text and "1 damaged step (2); the latest, step 4, is intact" in text


def _tree(path):
    """Every file and folder under `path` with its size: what a command must leave as it was."""
    return sorted((str(p.relative_to(path)), p.stat().st_size if p.is_file() else -1) for p in path.rglob("*"))


@pytest.fixture
def killed_mid_save(tmp_path):
    """A run directory with steps 1 and 2 committed and step 3 killed mid-save (orbax's temporary folder)."""
    import shutil

    run = tmp_path / "run"
    root = run / C.CHECKPOINTS_DIR
    with CheckpointManager(root) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"params": {"w": torch.full((64,), float(step))}}, metrics={"loss": 1.0 / step})
    shutil.copytree(root / "2", root / "3.orbax-checkpoint-tmp-1712345678")
    (root / "3.orbax-checkpoint-tmp-1712345678" / "_CHECKPOINT_METADATA").unlink()  # written at commit
    return run


def test_list_names_an_unfinished_save_and_leaves_it(killed_mid_save, capsys, caplog):
    import logging

    root = killed_mid_save / C.CHECKPOINTS_DIR
    before = _tree(killed_mid_save)
    assert cli.main(["list", str(killed_mid_save)]) == 0  # the committed steps are intact
    lines = capsys.readouterr().out.splitlines()
    assert _tree(killed_mid_save) == before  # nothing deleted, nothing written
    assert lines[0].startswith("2 checkpoints in ") and [line.split()[0] for line in lines[2:5]] == ["1", "2", "3"]
    assert lines[4].endswith("UNFINISHED: 3.orbax-checkpoint-tmp-1712345678/ never committed "
                             "(the process stopped mid-save)")
    assert lines[5] == ("1 unfinished save (3.orbax-checkpoint-tmp-1712345678/): not a checkpoint. `--resume` skips "
                        "it (the run removes it, logged) and restores the latest committed step; deleting it by "
                        "hand is safe.")
    with pytest.raises(CheckpointError, match=r"^step 3 was never committed \(3\.orbax-checkpoint-tmp-1712345678/: "
                                              r"the process stopped mid-save\) in .*; saved steps: 1, 2\. Pass --step"):
        cli.main(["export", str(killed_mid_save), "--step", "3", "--out", str(killed_mid_save / "m.safetensors")])
    assert _tree(killed_mid_save) == before
    with caplog.at_level(logging.WARNING, logger="ember.core.checkpoint.manager"):  # what a resumed run builds
        with CheckpointManager(root) as ckpt:
            assert ckpt.latest_step() == 2
    assert sorted(p.name for p in root.iterdir()) == ["1", "2"]
    assert "removing 1 unfinished save(s) (3.orbax-checkpoint-tmp-1712345678): a process stopped mid-save" in caplog.text


def test_export_of_a_missing_step_names_the_steps_and_the_flag(saved_run, tmp_path):
    directory, _, _ = saved_run
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError) as err:
        cli.main(["export", str(directory), "--step", "300", "--out", str(tmp_path / "m.safetensors")])
    assert str(err.value) == (f"no checkpoint for step 300 in {directory}; saved steps: 2. Pass --step with one "
                              f"of those, or leave --step out for the latest (2).")
    assert _tree(tmp_path) == before


def _files(folder):
    """`{relative path: (bytes, mtime_ns)}` of every file under `folder`."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


EXISTING = [  # (id, export flags, the file already there, relative to the --out; "" is the --out itself)
    ("file", [], ""),
    ("hf-folder", ["--hf"], "config.json"),
]


@pytest.mark.parametrize("flags, existing", [c[1:] for c in EXISTING], ids=[c[0] for c in EXISTING])
def test_export_replaces_nothing_without_overwrite(saved_run, tmp_path, capsys, flags, existing):
    """An existing --out (not even a safetensors file) or a file of the HF folder is refused with one
    `error:` line and exit 2, every file left as it was (bytes and mtimes); --overwrite replaces it."""
    from ember.launch.cli import run_main
    from ember.models import from_hf

    directory, state, _ = saved_run
    out = tmp_path / "out"
    target = out / existing if existing else out
    target.parent.mkdir(exist_ok=True)
    target.write_text("my notes, not a model\n")
    (tmp_path / "other.txt").write_text("untouched\n")
    before = _files(tmp_path)
    argv = ["export", str(directory), "--out", str(out), *flags]
    assert run_main(lambda: cli.main(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {out} already ")
    assert f"{existing or out}" in err and "pass another --out, or --overwrite to replace it" in err
    assert _files(tmp_path) == before
    assert run_main(lambda: cli.main([*argv, "--overwrite"])) == 0
    assert _files(tmp_path)["other.txt"] == before["other.txt"]
    if flags:
        assert torch.equal(from_hf(str(out))[1]["wte"]["weight"], state.params["wte"]["weight"])
    else:
        from safetensors.torch import load_file

        assert torch.equal(load_file(str(out))["wte.weight"], state.params["wte"]["weight"])


def test_hf_export_brings_the_tokenizer_files_of_the_runs_folder(tmp_path):
    """A run whose tokenizer came from a Hugging Face folder exports that folder's tokenizer files, chat
    template and token ids with --hf (and refuses to replace them, naming each)."""
    folder = tmp_path / "hf_model"
    folder.mkdir()
    tokenizer_files = {"tokenizer.json": '{"model": {}}', "tokenizer_config.json": '{"chat_template": "{{ x }}"}',
                       "special_tokens_map.json": "{}", "chat_template.jinja": "{{ messages }}"}
    for name, text in tokenizer_files.items():
        (folder / name).write_text(text)
    (folder / "config.json").write_text('{"model_type": "llama", "eos_token_id": 5, "bos_token_id": 4}')
    cfg = dataclasses.replace(_cfg(tmp_path / "run"), data=DataConfig(source="sft", tokenizer="model",
                                                                       tokenizer_path=str(folder)))
    model = build_model(cfg.family, cfg.model)
    with CheckpointManager(tmp_path / "run" / "checkpoints", async_save=False) as manager:
        manager.save(1, {"params": model.init(random.key(0))}, config=cfg, model_info=C.model_info_for(cfg),
                     force=True)
    out = tmp_path / "export"
    cli.main(["export", str(tmp_path / "run"), "--hf", "--out", str(out)])
    assert {name: (out / name).read_text() for name in tokenizer_files} == tokenizer_files
    import json

    hf = json.loads((out / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["model_type"]) == (4, 5, "llama")
    (out / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"already holds config.json, tokenizer.json, tokenizer_config.json, "
                                         r"special_tokens_map.json, chat_template.jinja; export never replaces"):
        cli.main(["export", str(tmp_path / "run"), "--hf", "--out", str(out)])
