"""Stage t: every test marked `gpu` (`pytest -m gpu` over the whole suite), with what passed, failed or skipped.

    python -m ember.launch.device_check.gpu_tests [PATH ...]     # default: the repository's tests/

Run from the repository root. Without CUDA the tests skip (tests/conftest.py), and the stage still
passes: the check's CPU mode uses it to prove the selection and the plumbing.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

import pytest
import torch

from .common import emit

MARKER = "gpu"
DEFAULT_PATHS = ["tests"]


class _Outcomes:
    """A pytest plugin that keeps the selected node ids, each test's outcome and the modules that failed to import."""

    def __init__(self) -> None:
        self.selected: List[str] = []
        self.outcomes: Dict[str, str] = {}
        self.collection_errors: List[str] = []

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collection_errors.append(report.nodeid)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.selected = [item.nodeid for item in session.items]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":  # setup skips and errors count too
            self.outcomes.setdefault(report.nodeid, report.outcome)


def pytest_args(paths: List[str]) -> List[str]:
    """The stage's pytest command line: the `gpu` marker over `paths`, no cache written, skips listed; a test
    module that fails to import on the device's image is reported, and the gpu tests still run."""
    return ["-m", MARKER, "-p", "no:cacheprovider", "-q", "-rs", "--continue-on-collection-errors", *paths]


def main(argv=None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv) or DEFAULT_PATHS
    plugin = _Outcomes()
    code = int(pytest.main(pytest_args(paths), plugins=[plugin]))
    counts = {k: sum(1 for o in plugin.outcomes.values() if o == k) for k in ("passed", "failed", "skipped")}
    res: Dict[str, Any] = {"cuda": torch.cuda.is_available(), "paths": paths, "selected": plugin.selected,
                           "collection_errors": plugin.collection_errors, "exit_code": code, **counts}
    if code != 0:
        res["error"] = "no test is marked gpu" if code == 5 else (
            f"pytest exited {code}: {counts['failed']} failed, modules that did not import: "
            f"{plugin.collection_errors or 'none'}")
    emit("gpu_tests", res)
    return code


if __name__ == "__main__":
    sys.exit(main())
