"""Architecture registry: lookup, listing, derived presets, loud errors; size helpers."""

from __future__ import annotations

import dataclasses

import pytest

from ember.core import random
from ember.models import (
    GPT2,
    GPT2Config,
    Llama3,
    Llama3Config,
    ModelRegistry,
    build_model,
    count_params,
    estimate_memory,
    get_config,
    list_archs,
    list_families,
)
from ember.models.layers import RopeScaling


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    width: int = 8
    depth: int = 1


@pytest.fixture
def reg() -> ModelRegistry:
    """A private registry, so these tests never touch the global one."""
    r = ModelRegistry()
    r.register_family("toy", ToyConfig, lambda cfg: ("model", cfg))
    return r


def test_builtin_families_and_archs():
    assert {"gpt2", "llama3"} <= set(list_families())  # user tests may register more
    assert list_archs("gpt2") == ["large", "medium", "small", "tiny", "xl"]
    assert list_archs("llama3") == ["125m", "1b", "3.1-8b", "3b", "70b", "8b", "tiny"]
    assert "llama3/8b" in list_archs() and "gpt2/tiny" in list_archs()


def test_get_config_and_build_model():
    cfg = get_config("llama3", "tiny")
    assert isinstance(cfg, Llama3Config) and cfg.vocab_size == 256
    assert get_config("llama3/tiny") == cfg
    model = build_model("llama3", "tiny")
    assert isinstance(model, Llama3) and model.config == cfg
    assert build_model("gpt2", GPT2Config(n_layers=2)).config.n_layers == 2
    assert build_model("gpt2/tiny", n_layers=1).config.n_layers == 1
    assert isinstance(build_model("gpt2", "small"), GPT2)


def test_derived_presets():
    base, derived = get_config("llama3", "8b"), get_config("llama3", "3.1-8b")
    assert derived == base.replace(rope_scaling=RopeScaling(factor=8.0), max_seq_len=131072)
    one_b = get_config("llama3", "1b")
    assert (one_b.d_model, one_b.n_layers, one_b.tie_embeddings, one_b.rope_scaling.factor) == (2048, 16, True, 32.0)
    assert get_config("gpt2", "medium") == GPT2Config(n_layers=24, n_heads=16, d_model=1024)


def test_overrides_are_validated():
    assert get_config("gpt2", "tiny", n_layers=2).n_layers == 2
    with pytest.raises(ValueError, match=r"no field 'nlayers'; did you mean 'n_layers'"):
        get_config("gpt2", "tiny", nlayers=2)
    with pytest.raises(ValueError, match=r"n_heads=3 does not divide"):
        get_config("gpt2", "tiny", n_heads=3)


def test_unknown_names_list_close_matches():
    known = r"Known: \[.*'gpt2', 'llama3'.*\]"  # other tests may register more families
    with pytest.raises(KeyError, match=r"unknown model family 'lama3'; did you mean 'llama3'\?.*" + known):
        get_config("lama3", "8b")
    with pytest.raises(KeyError, match=r"unknown llama3 architecture '8bb'; did you mean '8b'"):
        build_model("llama3", "8bb")
    with pytest.raises(KeyError, match=r"Known: \[.*'tiny'\]"):
        get_config("llama3", "huge")
    with pytest.raises(ValueError, match="no architecture given"):
        get_config("llama3")


def test_duplicate_registration_raises(reg):
    with pytest.raises(ValueError, match="model family 'toy' is already registered"):
        reg.register_family("toy", ToyConfig, lambda cfg: cfg)
    reg.arch("toy", "small")(lambda: ToyConfig())
    with pytest.raises(ValueError, match="toy architecture 'small' is already registered"):
        reg.arch("toy", "small")(lambda: ToyConfig(width=4))


def test_private_registry(reg):
    @reg.arch("toy", "base")
    def _base():
        return ToyConfig(width=16)

    @reg.arch("toy", "deep")
    def _deep():  # derived from another preset
        return dataclasses.replace(reg.get_config("toy", "base"), depth=4)

    assert reg.build_model("toy", "deep") == ("model", ToyConfig(width=16, depth=4))
    assert reg.list_archs() == ["toy/base", "toy/deep"]
    with pytest.raises(TypeError, match="needs an architecture name or a ToyConfig"):
        reg.build_model("toy", GPT2Config())
    with pytest.raises(KeyError, match="unknown model family 'gpt2'"):
        reg.get_config("gpt2", "tiny")  # the private registry has only its own families


def test_family_decorator_and_type_checks():
    r = ModelRegistry()

    @r.family("toy", config_cls=ToyConfig)
    def build(cfg):
        return cfg.width

    r.arch("toy", "bad")(lambda: GPT2Config())
    with pytest.raises(TypeError, match=r"architecture 'toy/bad' returned GPT2Config, expected a ToyConfig"):
        r.get_config("toy", "bad")
    with pytest.raises(TypeError, match="config_cls must be a dataclass type"):
        r.register_family("other", dict, build)
    with pytest.raises(KeyError, match="unknown model family 'tyo'; did you mean 'toy'"):
        r.arch("tyo", "x")


def test_llama3_8b_param_count_without_allocating():
    model = build_model("llama3", "8b")
    n = count_params(model)
    assert n == 8_030_261_248
    assert round(n / 1e9, 2) == 8.03


def test_estimate_memory():
    model = build_model("gpt2", "tiny")
    n = count_params(model)
    est = estimate_memory(model)
    assert (est.params, est.grads, est.optimizer, est.total) == (4 * n, 4 * n, 8 * n, 16 * n)
    bf16_sgd = estimate_memory(model, optimizer_slots=1, dtype_bytes=2)
    assert bf16_sgd.total == 6 * n
    assert "GiB" in str(est)
    assert count_params(model.init(random.key(0))) == n  # a params tree works too
    with pytest.raises(ValueError, match="optimizer_slots must be >= 0"):
        estimate_memory(model, optimizer_slots=-1)
    with pytest.raises(TypeError, match="found a str leaf"):
        count_params({"w": "not a tensor"})
