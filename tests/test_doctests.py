"""Every docstring example in the package runs, imported as `ember.*` (STYLE: doctests run in CI).

pytest's own --doctest-modules would import the repository root under its directory name, giving
each module a second copy with its own registries; importing through `ember` avoids that.
"""

import doctest
import importlib
import pkgutil

import pytest

import ember

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(ember.__path__, prefix="ember.")
    if not m.name.startswith(("ember.tests", "ember.launch"))
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples failed in {name} (output above)"
