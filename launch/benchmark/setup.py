"""What every benchmark variant shares: the `Setup` (model, weights, batch) and the `Variant` interface.

Public names: `Setup`, `Variant`, `build_setup`, `bench_optim_config`, `sync`.

Every variant trains the same model on the same weights and batch with AdamW at the run config's
hyperparameters, a constant learning rate, global-norm clipping at 1.0 and weight decay on matrices
only (`bench_optim_config`), and exposes `step()`, one synchronous training step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict

import torch

import ember.models as models
from ember.core import random
from ember.core.pytree import tree_flatten, tree_leaves, tree_leaves_with_path, tree_map, tree_unflatten

_FAST_INIT_ABOVE = 20_000_000  # params; ember's counter-RNG init of 129M params takes ~60 s on 2 cores


@dataclasses.dataclass
class Setup:
    """What every variant shares: config, model, initial params, one batch, device."""

    cfg: Any
    model: Any
    params: Any
    batch: Dict[str, torch.Tensor]
    device: torch.device
    init: str


@dataclasses.dataclass
class Variant:
    """One way to run the training step: `step()` runs one step to completion and returns the loss."""

    name: str
    step: Callable[[], Any]
    state_bytes: Callable[[], int]
    clear: Callable[[], None] = lambda: None  # drop what is held between steps but not state (grads)
    notes: str = ""
    device: str = "cpu"
    dtype: str = "float32"  # the dtype its matmuls compute in: its MFU is scored against that dtype's peak


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_setup(cfg: Any, *, device: torch.device, init: str = "auto") -> Setup:
    """The model, its initial params (ember init, or a seeded `torch.randn` one for big models) and a batch."""
    model = models.build_model(cfg.family, cfg.model)
    models.check_lm_data(model, seq_len=cfg.data.seq_len)
    shapes = model.param_shapes()
    n = sum(t.numel() for t in tree_leaves(shapes))
    if init == "auto":
        init = "fast" if n > _FAST_INIT_ABOVE else "ember"
    if init == "ember":
        params = model.init(random.key(cfg.seed))
    else:  # values do not matter for timing: N(0, init_std) matrices, unit norm weights, zero biases
        gen, std = torch.Generator().manual_seed(cfg.seed), cfg.model.init_std

        def fill(path: str, meta: torch.Tensor) -> torch.Tensor:
            if path.endswith("bias"):
                return torch.zeros(meta.shape, dtype=meta.dtype)
            if meta.dim() == 1:
                return torch.ones(meta.shape, dtype=meta.dtype)
            return torch.randn(meta.shape, generator=gen, dtype=meta.dtype) * std

        leaves, spec = tree_flatten(shapes)
        paths = [p for p, _ in tree_leaves_with_path(shapes)]
        params = tree_unflatten([fill(p, t) for p, t in zip(paths, leaves)], spec)
    gen = torch.Generator().manual_seed(1234)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, t + 1), generator=gen)  # (B, T+1)
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}  # (B, T) each
    to = lambda x: x.to(device)  # noqa: E731
    return Setup(cfg, model, tree_map(to, params), tree_map(to, batch), device, init)


def bench_optim_config(cfg: Any, schedule: str = "constant", name: str = "adamw") -> Any:
    """The run config's optimizer section as every variant uses it: AdamW (or `name`), `schedule`, clipping at 1.0."""
    return dataclasses.replace(cfg.optim, name=name, schedule=schedule, clip_norm=1.0)
