"""launch/bench_house.py counts the house's figures of a checkout (no time, no torch)."""

import pathlib
import subprocess
import sys

import pytest

from ember.launch import bench_house

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_figures_count_code_calls_and_private_names_but_not_docstring_mentions(tmp_path):
    core = tmp_path / "core"
    (core / "compat").mkdir(parents=True)
    (core / "testing").mkdir()
    (core / "compat" / "inductor.py").write_text("import torch\n\n# a comment\nx = torch._inductor.config\n")
    (core / "remat.py").write_text('"""Uses `torch.func.vjp(...)` and `is_dynamo_compiling()`."""\n'
                                   "if torch.compiler.is_dynamo_compiling():\n    torch.func.vjp(f, x)\n")
    (core / "tree_math.py").write_text("torch._foreach_add(a, b)\n")
    (core / "testing" / "helpers.py").write_text("torch._C._whatever()\n" * 50)
    got = bench_house.figures(tmp_path)
    assert got == {"core code lines": 6, "compile machinery lines": 5, "private torch names in core/compat/": 1,
                   "private torch names elsewhere in core/": 1, "is_dynamo_compiling() branches": 1,
                   "torch.func.vjp calls": 1, "files with a thread-local": 0, "import circles": 0,
                   "function-local ember imports": 0, "import circles counting function-local imports": 0,
                   "imports against the layers": 0}


def test_an_import_circle_counts_once_and_a_function_local_import_that_breaks_one_is_found(tmp_path):
    core = tmp_path / "core"
    (core / "pkg").mkdir(parents=True)
    (core / "pkg" / "__init__.py").write_text("from .inner import f\n")
    (core / "pkg" / "inner.py").write_text("from ..state import here\n\ndef f():\n    from ..top import g\n")
    (core / "state.py").write_text("import threading\n_local = threading.local()\n")
    (core / "top.py").write_text("from .pkg import f\nfrom . import state\n")
    (core / "a.py").write_text("from . import b\n")
    (core / "b.py").write_text("from .a import x\n")
    (core / "pytree.py").write_text("def f():\n    from .jit import jit\n")
    (core / "jit.py").write_text("from . import pytree\n")
    got = bench_house.figures(tmp_path)
    assert got["import circles"] == 1  # a <-> b; pkg.inner's import of state is no circle
    assert got["function-local ember imports"] == 2
    assert got["import circles counting function-local imports"] == 3  # and top -> pkg -> inner -> top, pytree <-> jit
    assert got["files with a thread-local"] == 1
    assert got["imports against the layers"] == 1  # pytree (the bottom layer) imports jit


def test_the_script_prints_one_column_per_checkout_and_names_a_wrong_root(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench_house.py"), str(ROOT), str(ROOT)],
                          capture_output=True, text=True, check=True)
    rows = proc.stdout.strip().splitlines()
    assert len(rows) == 2 + len(bench_house.FIGURES) and rows[2].startswith("| core code lines |")
    first, second = rows[2].split("|")[2:4]
    assert first == second and int(first.strip().replace(",", "")) > 1000
    with pytest.raises(SystemExit, match="has no core/ folder; pass the root of an ember checkout"):
        bench_house.figures(tmp_path)
