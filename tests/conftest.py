"""Shared pytest setup: strict, deterministic, CPU-only.

- `EMBER_REQUIRE_XLA=1` (set by `make test` on Linux x86-64, hence in CI) turns any skipped test
  marked `xla` into a failure, so a missing torch_xla can never pass silently.
- Tests marked `gpu` need a CUDA GPU: they skip without one (`make gpu-check` runs them).
- ember's own warnings are errors.
- Fixtures: `key` (a fresh RNG key), `tmp_out` (a run directory).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

torch.use_deterministic_algorithms(True, warn_only=True)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config: pytest.Config) -> None:
    warnings.filterwarnings("error", module=r"ember(\..*)?")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu)


def _xla_required() -> bool:
    return os.environ.get("EMBER_REQUIRE_XLA", "0") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _xla_required() and item.get_closest_marker("xla") is not None:
        report.outcome = "failed"
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = (
            f"{item.nodeid} is an XLA test and was skipped ({reason}), but EMBER_REQUIRE_XLA=1: "
            f"torch_xla must be installed here. Run `make install` (it installs the [xla] extra)."
        )


@pytest.fixture
def key():
    from ember.core import random

    return random.key(0)


@pytest.fixture
def tmp_out(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    return out
