"""Every preset that states its size ("~1.6M-parameter") states the size of the model it builds."""

import re

import pytest

from ember.launch import build
from ember.launch.run_config import describe_configs, get_config
from ember.models.summary import count_params

SIZE = re.compile(r"~(\d+(?:\.\d+)?)M-parameter")


def test_some_presets_state_their_size():
    assert {"llama3_tiny", "llama3_125m"} <= {name for name, doc in describe_configs().items() if SIZE.search(doc)}


@pytest.mark.parametrize("name", sorted(describe_configs()))
def test_stated_size_matches_the_built_model(name):
    for stated in SIZE.findall(describe_configs()[name]):
        decimals = len(stated.partition(".")[2])
        built = count_params(build.build_model(get_config(name))) / 1e6  # from shapes: nothing allocated
        assert round(built, decimals) == float(stated), f"{name}: says ~{stated}M, builds {built:.2f}M"
