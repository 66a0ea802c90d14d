"""The README's command blocks that build their own model folder first (`launch/tiny_chat.py`), run in order."""

import pathlib
import re
import shlex

import pytest

from ember.launch import ckpt, train
from ember.launch.tiny_chat import main as tiny_chat_main

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_section(heading):
    """The README's text after the line `heading` (e.g. "## Preference optimization")."""
    return README.read_text().split(f"{heading}\n", 1)[1]


def readme_commands(heading):
    """The words of each `python ...` command in the first bash block after `heading`."""
    block = re.search(r"```bash\n(.*?)```", readme_section(heading), re.S).group(1)
    return [shlex.split(line.split(" #")[0]) for line in block.splitlines() if line.startswith("python ")]


def run_readme_commands(root, heading, train_flags):
    """Run the block's commands in `root`, each training command with `train_flags` appended (the flags as written
    still parse); returns `{--out: the run's history}`."""
    histories, patch = {}, pytest.MonkeyPatch()
    patch.chdir(root)
    try:
        for _, script, *argv in readme_commands(heading):
            if script == "launch/tiny_chat.py":
                tiny_chat_main(argv)
            elif script == "launch/train.py":
                histories[argv[argv.index("--out") + 1]] = train.main(argv + train_flags)
            else:
                assert script == "launch/ckpt.py" and ckpt.main(argv) == argv[argv.index("--out") + 1]
    finally:
        patch.undo()
    return histories
