"""Shared problems and the optimizer table for the ember.optim tests (imported by the test files).

- `mlp_params()` / `mlp_grad(params)`: a fixed two-layer tanh MLP regression (matrices and biases,
  so weight-decay masks matter), gradients from `torch.func.grad`.
- `quadratic_params()` / `quadratic_loss(params)`: a diagonal quadratic with minimum at `TARGET`.
- `OPTIMIZERS_UNDER_TEST`: every optimizer configuration crossed with the property tests.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

import torch

from ember import optim
from ember.core import pytree

_GEN_SEED = 1234


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(_GEN_SEED)


def mlp_params(dtype: torch.dtype = torch.float32) -> Dict[str, Dict[str, torch.Tensor]]:
    """A fixed 8 -> 16 -> 4 MLP."""
    g = _gen()
    params = {
        "l1": {"w": torch.randn(16, 8, generator=g) * 0.1, "b": torch.randn(16, generator=g) * 0.1},
        "l2": {"w": torch.randn(4, 16, generator=g) * 0.1, "b": torch.zeros(4)},
    }
    return pytree.tree_map(lambda t: t.to(dtype), params)


def _mlp_data():
    g = torch.Generator().manual_seed(_GEN_SEED + 1)
    x = torch.randn(32, 8, generator=g)
    y = torch.sin(x @ torch.randn(8, 4, generator=g))
    return x, y


_X, _Y = _mlp_data()


def mlp_loss(params, x: torch.Tensor = _X, y: torch.Tensor = _Y) -> torch.Tensor:
    h = torch.tanh(x @ params["l1"]["w"].T + params["l1"]["b"])  # (32, 16)
    out = h @ params["l2"]["w"].T + params["l2"]["b"]  # (32, 4)
    return ((out - y) ** 2).mean()


def mlp_grad(params):
    return torch.func.grad(mlp_loss)(params)


# Diagonal quadratic 0.5 * sum(c * (p - target)^2): curvatures from 0.5 to 2.
TARGET = {"w": torch.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": torch.tensor([0.5, -0.5, 1.0])}
_CURVATURE = {"w": torch.linspace(0.5, 2.0, 12).reshape(3, 4), "b": torch.tensor([1.0, 2.0, 0.5])}


def quadratic_params(dtype: torch.dtype = torch.float32):
    return {"w": torch.zeros(3, 4, dtype=dtype), "b": torch.zeros(3, dtype=dtype)}


def quadratic_loss(params) -> torch.Tensor:
    return sum(
        0.5 * (_CURVATURE[k] * (params[k].float() - TARGET[k]) ** 2).sum() for k in ("w", "b")
    )


def quadratic_grad(params):
    """Analytic gradient, in each param's dtype."""
    return {
        k: (_CURVATURE[k] * (params[k].float() - TARGET[k])).to(params[k].dtype) for k in params
    }


@dataclasses.dataclass(frozen=True)
class Case:
    """One optimizer configuration; `make()` builds a fresh GradientTransformation."""

    id: str
    make: Callable[[], optim.GradientTransformation]
    converge_steps: int = 300


OPTIMIZERS_UNDER_TEST: List[Case] = [
    Case("adamw", lambda: optim.adamw(5e-2, weight_decay=1e-4)),
    Case("adamw_decay_mask", lambda: optim.adamw(5e-2, weight_decay=1e-3, mask=optim.decay_mask)),
    Case("adam_cosine", lambda: optim.adam(optim.cosine_decay_schedule(0.1, 300))),
    Case("sgd", lambda: optim.sgd(0.2)),
    Case("sgd_momentum", lambda: optim.sgd(0.05, momentum=0.9, weight_decay=1e-4)),
    Case("sgd_nesterov", lambda: optim.sgd(0.05, momentum=0.9, nesterov=True)),
    Case("lion", lambda: optim.lion(optim.cosine_decay_schedule(2e-2, 300), weight_decay=0.0)),
    Case("adafactor", lambda: optim.adafactor(5e-2, min_dim_size_to_factor=3)),
    Case(
        "clip_then_adamw_warmup",
        lambda: optim.chain(
            optim.clip_by_global_norm(1.0),
            optim.adamw(optim.warmup_cosine_decay_schedule(0.0, 5e-2, 10, 300)),
        ),
    ),
    Case("multi_steps_adam", lambda: optim.multi_steps(optim.adam(5e-2), every_k=2), 600),
    # the matrices to Muon (each orthogonalised whole on a mesh), the biases to its AdamW group
    Case("muon", lambda: optim.muon(2e-2, weight_decay=1e-4, adam_learning_rate=5e-2)),
    Case("schedule_free_adamw", lambda: optim.schedule_free_adamw(5e-2, warmup_steps=5, weight_decay=1e-4)),
    Case("partition_adamw_sgd", lambda: optim.partition(
        {"matrix": optim.adamw(5e-2, weight_decay=1e-4), "vector": optim.sgd(0.05, momentum=0.9)},
        lambda p: pytree.tree_map(lambda x: "matrix" if x.ndim >= 2 else "vector", p))),
]
CASE_IDS = [c.id for c in OPTIMIZERS_UNDER_TEST]


def run_steps(tx, params, grad_fn, steps: int):
    """`steps` eager updates; returns (params, state)."""
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(grad_fn(params), state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def max_abs_diff(a, b) -> float:
    """Largest |a - b| over all leaves, matched by path (dict key order may differ)."""
    da, db = dict(pytree.tree_leaves_with_path(a)), dict(pytree.tree_leaves_with_path(b))
    assert sorted(da) == sorted(db), (sorted(da), sorted(db))
    return max(float((da[k].double() - db[k].double()).abs().max()) for k in da)
