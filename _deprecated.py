"""Import paths that moved in 0.2, kept working for one release with a DeprecationWarning each.

They live here, in the root package, because the new homes are upper floors (`ember.launch`,
`ember.optim`, `ember.data`) that `core` and `models` may not import. Removed in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import Dict, Optional

__all__ = ["install"]

# Old module -> {name: new module}; "*" is where every other name went.
MOVED_MODULES: Dict[str, Dict[str, str]] = {
    "ember.core.config": {"OptimConfig": "ember.optim.config", "DataConfig": "ember.data.config",
                          "*": "ember.launch.run_config"},
    "ember.core.metrics_log": {"*": "ember.launch.metrics_log"},
    "ember.core.host_memory": {"*": "ember.launch.host_memory"},
    "ember.core.step_fns.loop": {"*": "ember.launch.loop"},
    "ember.models.run_configs": {"*": "ember.launch.presets"},
}
# Package -> {name: new module} for names that were attributes of a package.
MOVED_NAMES: Dict[str, Dict[str, str]] = {
    "ember.core": {"config": "ember.core.config"},  # the module alias above
    "ember.core.step_fns": {"train_loop": "ember.launch.loop", "evaluate": "ember.launch.loop"},
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path is removed in ember 0.3. Import it from {new}.",
                  DeprecationWarning, stacklevel=3)


class _MovedModule(types.ModuleType):
    """Stands for a moved module: each attribute is read from the module it now lives in."""

    def __getattr__(self, name: str):
        moves = MOVED_MODULES[self.__name__]
        target = moves.get(name, moves["*"])
        return getattr(importlib.import_module(target), name)


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED_MODULES else None

    def create_module(self, spec) -> types.ModuleType:
        return _MovedModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        targets = sorted(set(MOVED_MODULES[module.__name__].values()))
        _warn(module.__name__, " and ".join(targets))


def _package_getattr(package: str):
    def __getattr__(name: str):
        target = MOVED_NAMES[package].get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if target in MOVED_MODULES:  # a moved module: importing it warns
            return importlib.import_module(target)
        _warn(f"{package}.{name}", f"{target}.{name}")
        return getattr(importlib.import_module(target), name)

    return __getattr__


def install() -> None:
    """Resolve the old paths: a finder for moved modules, `__getattr__` on packages that lost names."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
    for package in MOVED_NAMES:
        importlib.import_module(package).__getattr__ = _package_getattr(package)
