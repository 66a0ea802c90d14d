"""Tests for ember.core.registry.Registry."""

import pytest

from ember.core.registry import Registry


def test_register_get_names():
    reg = Registry("collator")
    reg.add("lm", 1)
    reg.register("mlm")(2)
    assert reg.get("mlm") == 2 and reg.names() == ["lm", "mlm"] and "lm" in reg and len(reg) == 2


def test_duplicate_raises():
    reg = Registry("model family")
    reg.add("gpt2", 1)
    with pytest.raises(ValueError, match="model family 'gpt2' is already registered"):
        reg.add("gpt2", 2)


def test_unknown_lists_close_matches_and_known():
    reg = Registry("config")
    for n in ["llama3_tiny", "llama3_125m", "gpt2_tiny"]:
        reg.add(n, n)
    with pytest.raises(KeyError, match=r"unknown config 'llama3_tin'; did you mean 'llama3_tiny'.*Known: \["):
        reg.get("llama3_tin")


def test_bad_name_type():
    with pytest.raises(TypeError, match="non-empty strings"):
        Registry("x").add("", 1)
