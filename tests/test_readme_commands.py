"""The README's shell commands copy-paste: every block names its environment, every training command's
flags and config are valid (checked with --dry-run), and every run writes into its own --out."""

import pathlib
import re
import shlex

import pytest

from ember.launch import train

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, re.S)
# A block that builds its own model folder first (`launch/tiny_chat.py`) runs whole, in order
# (tests/launch/_readme_runs.py, from test_finetune.py and test_dpo_run.py); the checks of single commands
# below take the other blocks.
SINGLE_COMMAND_BLOCKS = [block for block in BLOCKS if "launch/tiny_chat.py" not in block]


def _commands(block):
    return [line.split(" #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def _script_commands(script):
    """(command, its arguments after `script`) for every README command that runs `script`."""
    for block in SINGLE_COMMAND_BLOCKS:
        for command in _commands(block):
            words = shlex.split(command)
            if script in words:
                yield command, words[words.index(script) + 1:]


def _train_commands():
    return _script_commands("launch/train.py")


def test_every_block_that_runs_python_names_its_environment():
    for block in BLOCKS:
        commands = _commands(block)
        bare = [c for c in commands if re.search(r"(^|\s)(python|torchrun)\s", c)]
        if bare:
            assert commands[0] == "source .venv/bin/activate", f"a block runs {bare[0]!r} without activating .venv"


def test_every_training_command_has_its_own_out():
    outs = [words[words.index("--out") + 1] for _, words in _train_commands() if "--out" in words]
    commands = [c for c, _ in _train_commands()]
    resumed = sum("--resume" in c for c in commands)
    assert len(outs) == len(commands) and len(set(outs)) == len(outs) - resumed, commands


@pytest.mark.parametrize("command, argv", list(_train_commands()), ids=[c for c, _ in _train_commands()])
def test_every_training_command_is_valid_as_written(command, argv, tmp_path, monkeypatch, capsys):
    if "--import" in argv:  # the README's own package, saved where the command's PYTHONPATH=. finds it
        source = re.search(r"```python\n(# my_models\.py.*?)```", README, re.S).group(1)
        (tmp_path / "my_models.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    assert train.main([*argv, "--dry-run"]) is None, command
    assert "total:" in capsys.readouterr().out




def test_checkpoint_commands_run_as_written_and_write_only_where_gitignore_covers(tmp_path, monkeypatch):
    """Run from a repository root holding the run the README trained (steps 100-300), each `ckpt.py` command
    writes nothing outside a folder .gitignore covers (`/runs/`, `/out/`)."""
    import torch

    from ember.core.checkpoint import CheckpointManager
    from ember.launch import ckpt

    gitignore = (pathlib.Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    ignored = {line.strip("/") for line in gitignore if line.startswith("/") and line.endswith("/")}
    commands = list(_script_commands("launch/ckpt.py"))
    assert [argv[0] for _, argv in commands] == ["list", "export"], commands
    monkeypatch.chdir(tmp_path)
    for run in {argv[1] for _, argv in commands}:
        with CheckpointManager(pathlib.Path(run) / "checkpoints") as manager:
            for step in (100, 200, 300):
                manager.save(step, {"params": {"w": torch.full((4,), float(step))}}, metrics={"loss": 1.0})
    before = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    for command, argv in commands:
        assert ckpt.main(argv) in (0, argv[-1]), command  # list: 0 (all intact); export: the path written
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")} - before
    assert written and all(pathlib.PurePath(p).parts[0] in ignored for p in written), (written, ignored)
