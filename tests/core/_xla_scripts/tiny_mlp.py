"""A tiny 2-layer MLP regression step for the `ember.core.jit` tests (shared with the XLA scripts).

Public names: `Momentum`, `momentum`, `init_state`, `make_batch`, `loss_fn`, `train_step`,
`set_lr`.

Self-contained on purpose: the optimizer is an inline momentum SGD over `ember.core.tree_math`,
with the learning rate held as a 0-d float32 tensor in the optimizer state (so changing it must
not recompile), and gradients come straight from `torch.func.grad_and_value`.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Tuple

import torch
from torch import Tensor

from ember.core import TrainState, random, tree_math

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 32


class Momentum(NamedTuple):
    """A GradientTransformation-shaped pair (`init`, `update`) for heavy-ball momentum SGD."""

    init: Any
    update: Any


def momentum(lr: float, beta: float = 0.9) -> Momentum:
    """Momentum SGD: `mu = beta * mu + g`; `update = -lr * mu`; lr lives in the state as a tensor."""

    def init_fn(params):
        leaves = list(params.values())
        return {"mu": tree_math.tree_zeros_like(params),
                "lr": torch.tensor(lr, dtype=torch.float32, device=leaves[0].device)}

    def update_fn(grads, state, params=None):
        del params
        mu = tree_math.tree_add(tree_math.tree_scale(state["mu"], beta), grads)
        updates = tree_math.tree_scale(mu, -state["lr"])
        return updates, {"mu": mu, "lr": state["lr"]}

    return Momentum(init_fn, update_fn)


def init_params(seed: int = 0) -> Dict[str, Tensor]:
    """Parameters of the MLP, float32, on CPU."""
    k1, k2 = random.split(random.key(seed))
    return {
        "w1": random.normal(k1, (IN, HIDDEN)) * IN**-0.5,
        "b1": torch.zeros(HIDDEN),
        "w2": random.normal(k2, (HIDDEN, OUT)) * HIDDEN**-0.5,
        "b2": torch.zeros(OUT),
    }


def init_state(device: Any = "cpu", *, lr: float = 0.05, seed: int = 0) -> TrainState:
    """A fresh TrainState with params moved to `device`, then created there (zeros made on device)."""
    params = {k: v.to(device) for k, v in init_params(seed).items()}
    return TrainState.create(params=params, tx=momentum(lr), key=random.key(seed).to(device))


def make_batch(i: int, device: Any = "cpu") -> Tuple[Tensor, Tensor]:
    """Batch `i` (deterministic, different contents per `i`, same shapes)."""
    k = random.fold_in(random.key(1234), i)
    kx, ky = random.split(k)
    x = random.normal(kx, (BATCH, IN))
    y = torch.sin(x[:, :OUT]) + 0.1 * random.normal(ky, (BATCH, OUT))
    return x.to(device), y.to(device)


def loss_fn(params: Dict[str, Tensor], batch: Tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    h = torch.tanh(x @ params["w1"] + params["b1"])  # (B, HIDDEN)
    pred = h @ params["w2"] + params["b2"]  # (B, OUT)
    return ((pred - y) ** 2).mean()


def train_step(state: TrainState, batch: Tuple[Tensor, Tensor]) -> Tuple[TrainState, Dict[str, Tensor]]:
    """Pure step: `(state, batch) -> (state, {"loss", "grad_norm"})`."""
    grads, loss = torch.func.grad_and_value(loss_fn)(state.params, batch)
    new_state = state.apply_gradients(grads=grads)
    return new_state, {"loss": loss, "grad_norm": tree_math.global_norm(grads)}


def set_lr(state: TrainState, lr: float) -> TrainState:
    """The same state with a new learning-rate tensor (same shape and dtype: must not recompile)."""
    lr_t = torch.tensor(lr, dtype=torch.float32).to(state.opt_state["lr"].device)
    return state.replace(opt_state={**state.opt_state, "lr": lr_t})
