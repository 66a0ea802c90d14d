"""What `pip install ember` gets: a wheel built from this tree holds every module of the source, and
every module imports from it in a fresh interpreter that cannot see the source tree (the editable
install hides a missing package: it maps `ember` onto the whole folder)."""

import json
import os
import pathlib
import shutil
import site
import sys
import zipfile

import pytest
from _processes import run_in_own_group

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests", "build", "docs", "runs", "out"}  # top-level folders that are not the package

_IMPORT_EVERY_MODULE = """
import importlib, json, pathlib, pkgutil, sys
import ember
failed = {}
names = [m.name for m in pkgutil.walk_packages(ember.__path__, prefix="ember.")]
for name in names:
    try:
        importlib.import_module(name)
    except BaseException as err:
        failed[name] = f"{type(err).__name__}: {err}"[:300]
print(json.dumps({"file": ember.__file__, "count": len(names), "failed": failed}))
"""


def _source_modules() -> set:
    """`ember/<path>` for every .py file of the package's folders (what the wheel must hold)."""
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_SHIPPED or any(p.startswith(".") or p.endswith(".egg-info") for p in rel.parts):
            continue
        if rel != pathlib.Path("setup.py"):
            found.add(f"ember/{rel.as_posix()}")
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """A wheel built as a user builds one (`pip wheel`), from a copy of the tree without build leftovers."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__",
                                                              "runs", "out"))
    # The build backend comes from the test environment ([test] installs setuptools): no download.
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
               "-w", str(tmp / "dist"), str(src)]
    built = run_in_own_group(command, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel_file,) = (tmp / "dist").glob("ember-*.whl")
    return wheel_file


@pytest.mark.slow
def test_the_wheel_holds_every_module_of_the_source(wheel):
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    assert _source_modules() - shipped == set(), "modules missing from the wheel (a package without __init__.py?)"
    assert shipped - _source_modules() == set(), "the wheel ships files that are not ember's modules"


@pytest.mark.slow
def test_every_module_imports_from_the_wheel_alone(wheel, tmp_path):
    """`python -S` skips the .pth files, so the editable install's finder is not there; the installed
    dependencies stay reachable through PYTHONPATH."""
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env["PYTHONPATH"] = os.pathsep.join([str(unpacked), *site.getsitepackages()])
    out = run_in_own_group([sys.executable, "-S", "-c", _IMPORT_EVERY_MODULE], cwd=tmp_path, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert pathlib.Path(got["file"]).is_relative_to(unpacked), got["file"]
    assert got["failed"] == {}, got["failed"]
    assert got["count"] >= len(_source_modules()) - 1  # every module but `ember/__init__.py` itself
