"""The contracts in `ember.core.protocols` are what the other layers build: every optimizer alias is
a `GradientTransformation`, every registered family builds a `Model`, and core refuses what is not."""

import pytest
import torch

from ember import optim
from ember.core import TrainState
from ember.core.protocols import GradientTransformation, Model
from ember.core.step_fns import train_step
from ember.models import build_model, from_torch, list_families


@pytest.mark.parametrize("tx", [optim.adamw(1e-3), optim.sgd(0.1), optim.lion(1e-4), optim.adafactor(),
                                optim.chain(optim.clip_by_global_norm(1.0), optim.adam(1e-3))])
def test_optim_builds_gradient_transformations(tx):
    assert isinstance(tx, GradientTransformation)


@pytest.mark.parametrize("family", list_families())
def test_every_family_builds_a_model(family):
    assert isinstance(build_model(family, "tiny"), Model)


def test_a_bridged_torch_module_is_a_model():
    model, _params = from_torch(torch.nn.Linear(2, 3))
    assert isinstance(model, Model)


def test_core_refuses_what_is_not_a_gradient_transformation():
    with pytest.raises(TypeError, match=r"TrainState.create\(tx=...\) expects a gradient transformation"):
        TrainState.create(params={"w": torch.zeros(2)}, tx=object())
    with pytest.raises(TypeError, match=r"train_step\(tx=...\) expects a gradient transformation"):
        train_step(lambda p, b, *, key: p["w"].sum(), tx=lambda g: g)
