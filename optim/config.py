"""Build a gradient transformation from a run config's `OptimConfig`.

Public names: `from_config`, `schedule_from_config`.

The optimizer half of `launch/train.py`, importable by a user's own script.

Example:
    >>> import torch
    >>> from ember.core.config import OptimConfig
    >>> tx = from_config(OptimConfig(name="adamw", learning_rate=1e-3), total_steps=100)
    >>> state = tx.init({"w": torch.zeros(2, 2)})
"""

from __future__ import annotations

from ..core.config import OptimConfig
from ..core.types import Schedule
from .aliases import adafactor, adam, adamw, lion, sgd
from .base import GradientTransformation
from .clipping import clip_by_global_norm
from .combining import chain
from .hyperparams import inject_hyperparams
from .masking import decay_mask
from .schedules import constant_schedule, cosine_decay_schedule, warmup_cosine_decay_schedule

__all__ = ["from_config", "schedule_from_config"]


def schedule_from_config(cfg: OptimConfig, *, total_steps: int) -> Schedule:
    """The learning-rate schedule of `cfg` over a run of `total_steps` steps."""
    end = cfg.learning_rate * cfg.end_lr_ratio
    if cfg.schedule == "constant":
        return constant_schedule(cfg.learning_rate)
    if cfg.schedule == "cosine":
        return cosine_decay_schedule(cfg.learning_rate, max(total_steps, 1), alpha=cfg.end_lr_ratio)
    if cfg.warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps must be >= 0, got {cfg.warmup_steps}.")
    warmup = min(cfg.warmup_steps, total_steps // 10)  # short runs (--steps 20) keep a decay phase
    return warmup_cosine_decay_schedule(0.0, cfg.learning_rate, warmup, max(total_steps, 1), end)


def from_config(cfg: OptimConfig, *, total_steps: int) -> GradientTransformation:
    """`clip_by_global_norm` (if `cfg.clip_norm`) chained with the optimizer alias `cfg.name`.

    Weight decay applies to matrices only (`decay_mask`: no decay on norms and biases). The clip
    norm is a hyperparameter tensor in the state too, so changing it never recompiles.
    """
    lr = schedule_from_config(cfg, total_steps=total_steps)
    if cfg.name == "adamw":
        tx = adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    elif cfg.name == "adam":
        tx = adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    elif cfg.name == "sgd":
        tx = sgd(lr, momentum=cfg.b1 or None, weight_decay=cfg.weight_decay)
    elif cfg.name == "lion":
        tx = lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
    elif cfg.name == "adafactor":
        tx = adafactor(lr, weight_decay_rate=cfg.weight_decay or None, weight_decay_mask=decay_mask)
    else:
        raise ValueError(
            f"optim.name={cfg.name!r} is not an optimizer; choose one of adamw, adam, sgd, lion, adafactor."
        )
    if cfg.clip_norm is None:
        return tx
    return chain(inject_hyperparams(clip_by_global_norm)(max_norm=cfg.clip_norm), tx)
