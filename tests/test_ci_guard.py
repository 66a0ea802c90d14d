"""The CI guard in tests/conftest.py: with EMBER_REQUIRE_XLA=1 a skipped `xla` test fails."""

import pathlib

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (pathlib.Path(__file__).with_name("conftest.py")).read_text()
SKIPPING_XLA_TEST = """
import pytest

@pytest.mark.xla
def test_needs_xla():
    pytest.importorskip("a_module_that_is_not_installed", reason="torch_xla is not installed")

def test_plain_skip_is_fine():
    pytest.skip("not an xla test")
"""


@pytest.mark.parametrize("required, failed", [("1", 1), ("0", 0)], ids=["required", "not-required"])
def test_skipped_xla_test_fails_only_when_required(pytester, monkeypatch, required, failed):
    monkeypatch.setenv("EMBER_REQUIRE_XLA", required)
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    xla: needs torch_xla\n")
    pytester.makepyfile(SKIPPING_XLA_TEST)
    result = pytester.runpytest_subprocess("-q")
    result.assert_outcomes(failed=failed, skipped=2 - failed)
    if failed:
        result.stdout.fnmatch_lines(["*EMBER_REQUIRE_XLA=1*torch_xla must be installed*"])
