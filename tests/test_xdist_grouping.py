"""The suite's `--dist loadgroup` keeps an `xdist_group` module on one worker, so its module fixture (a
compile, a multi-process launch: up to minutes on two cores) runs once. pytest 9.2 with pytest-xdist 3.8
drops the grouping silently (pytest-dev/pytest-xdist#1386) and doubled those fixtures in CI: the [test]
extra caps pytest, and this checks the installed pair on a two-worker session of its own."""

import os
import subprocess
import sys

GROUPED = '''
import os, pytest
pytestmark = pytest.mark.xdist_group("one")

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    with open(os.environ["SETUPS"], "a") as f:
        f.write(f"{os.getpid()}\\n")

@pytest.mark.parametrize("i", range(6))
def test_grouped(shared, i):
    pass
'''
OTHER = '''
import pytest

@pytest.mark.parametrize("i", range(6))
def test_other(i):
    pass
'''


def test_a_grouped_modules_fixture_runs_once_over_two_workers(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_other.py").write_text(OTHER)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repository's options
    setups = tmp_path / "setups.txt"
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "SETUPS": str(setups)},
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = setups.read_text().split()
    assert len(workers) == 1, (
        f"the grouped module's fixture ran on {len(workers)} workers: this pytest / pytest-xdist pair does not "
        f"group (pytest-dev/pytest-xdist#1386); install what pyproject.toml's [test] extra allows: pip install -e '.[test]'")
