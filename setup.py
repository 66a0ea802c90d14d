"""Package discovery for the root-as-package layout: every package under the repository root is
`ember.<name>` (pyproject.toml maps "ember" to "."), so a new folder ships without editing a list."""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithoutThisScript(build_py):
    """The root is the package `ember`, so this script would otherwise ship as `ember.setup`."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("ember", "setup")]


HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":  # how setuptools runs it; an editable install can import it as a module
    subpackages = find_packages(HERE, exclude=("tests", "tests.*", "build", "build.*"))
    setup(packages=["ember", *(f"ember.{name}" for name in subpackages)],
          cmdclass={"build_py": BuildPyWithoutThisScript})
