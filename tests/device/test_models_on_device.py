"""Model paths with the state on a GPU: a MoE train step (routing, dispatch), LoRA, the from_torch bridge."""

import torch
from simulated_cuda import on_device

from ember import models, optim
from ember.core import TrainState, jit, random
from ember.core.step_fns import train_step
from ember.models.objectives import lm_loss


def _one_step(model, params, cuda):
    tx = optim.adamw(1e-3)
    state = TrainState.create(params=params, tx=tx, key=random.key(0, device=cuda))
    tokens = torch.randint(0, 64, (2, 9)).to(cuda)
    state, metrics = jit(train_step(lm_loss(model), tx), backend="eager")(
        state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    assert metrics["loss"].is_cuda and torch.isfinite(metrics["loss"])
    return state


def test_moe_train_step(cuda):
    model = models.build_model("qwen3_moe", "tiny")
    state = _one_step(model, on_device(model.init(random.key(0))), cuda)
    assert all(t.is_cuda for t in torch.utils._pytree.tree_leaves(state.params))


def test_lora_train_step(cuda):
    base = models.build_model("llama3", "tiny")
    lora = models.to_lora(base, rank=2)
    _one_step(lora, lora.init_from(on_device(base.init(random.key(0))), key=random.key(1)), cuda)


def test_bridged_module(cuda):
    model, params = models.from_torch(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)))
    params, x = on_device(params), torch.randn(3, 4).to(cuda)
    grads = torch.func.grad(lambda p: model.apply(p, x).square().sum())(params)
    assert all(g.is_cuda for g in torch.utils._pytree.tree_leaves(grads))
