"""Import paths that moved in 0.2 still work for one release, each with a DeprecationWarning naming
the new path, and give the very objects the new paths give."""

import importlib
import sys

import pytest

import ember
from ember._deprecated import MOVED_MODULES, MOVED_NAMES

OLD_NAMES = {
    "ember.core.config": ["TrainConfig", "OptimConfig", "DataConfig", "parse_cli", "register_config", "to_dict"],
    "ember.core.metrics_log": ["MetricsWriter", "read_metrics", "plot_losses"],
    "ember.core.host_memory": ["retain_freed_host_memory"],
    "ember.core.step_fns.loop": ["train_loop", "evaluate"],
    "ember.models.run_configs": ["llama3_tiny", "gpt2_tiny", "llama3_125m"],
}


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_warns_and_forwards(old):
    assert set(OLD_NAMES) == set(MOVED_MODULES)
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to .*removed in ember 0.3"):
        module = importlib.import_module(old)
    for name in OLD_NAMES[old]:
        target = MOVED_MODULES[old].get(name, MOVED_MODULES[old]["*"])
        assert getattr(module, name) is getattr(importlib.import_module(target), name)


@pytest.mark.parametrize("package,name", [(p, n) for p, names in sorted(MOVED_NAMES.items()) for n in sorted(names)])
def test_a_moved_name_warns_and_forwards(package, name):
    if MOVED_NAMES[package][name] in MOVED_MODULES:  # a moved module warns when it is first imported
        sys.modules.pop(MOVED_NAMES[package][name], None)
        vars(importlib.import_module(package)).pop(name, None)  # the import bound it on its package
    with pytest.warns(DeprecationWarning, match="removed in ember 0.3"):
        got = getattr(importlib.import_module(package), name)
    assert got is not None
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        getattr(importlib.import_module(package), "nope")


def test_new_paths_do_not_warn(recwarn):
    from ember.data import DataConfig  # noqa: F401
    from ember.launch import TrainConfig, train_loop  # noqa: F401
    from ember.optim import OptimConfig  # noqa: F401

    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "ember" in str(w.message)]
    assert ember.__name__ == "ember"
