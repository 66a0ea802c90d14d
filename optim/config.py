"""`OptimConfig`, the optimizer section of a run config, and the gradient transformation it builds.

Public names: `OptimConfig`, `from_config`, `schedule_from_config`.

The optimizer half of `launch/train.py`, importable by a user's own script.

Example:
    >>> import torch
    >>> tx = from_config(OptimConfig(name="adamw", learning_rate=1e-3), total_steps=100)
    >>> state = tx.init({"w": torch.zeros(2, 2)})
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Literal, Optional

from ..core.config_checks import (Check, check_fields, finite_non_negative, finite_positive, fraction,
                                  non_negative_int, optional)
from ..core.types import PyTree, Schedule
from .adafactor import adafactor
from .aliases import adam, adamw, lion, sgd
from .base import GradientTransformation
from .clipping import clip_by_global_norm
from .combining import chain
from .hyperparams import inject_hyperparams
from .masking import decay_mask
from .muon import muon
from .schedules import (constant_schedule, cosine_decay_schedule, warmup_cosine_decay_schedule,
                        warmup_stable_decay_schedule)

__all__ = ["OptimConfig", "from_config", "schedule_from_config"]

def _muon(c: "OptimConfig", lr: Schedule, adam_lr: Schedule, axes: PyTree) -> GradientTransformation:
    return muon(lr, beta=c.muon_momentum, eps=c.eps, weight_decay=c.weight_decay, nesterov=True, adam_b1=c.b1,
                adam_b2=c.b2, adam_weight_decay=c.weight_decay, adam_learning_rate=adam_lr,
                consistent_rms=0.2 if c.muon_adjust_lr == "match_rms_adamw" else None,
                param_axes=axes)


# The one list of optimizer names: `OptimConfig.name` offers exactly these (tyro's --help lists them); muon,
# which labels the model's matrices by their logical axes, is built apart (`from_config`).
_OPTIMIZERS: Dict[str, Callable[["OptimConfig", Schedule], GradientTransformation]] = {
    "adamw": lambda c, lr: adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=decay_mask),
    "adam": lambda c, lr: adam(lr, b1=c.b1, b2=c.b2, eps=c.eps),
    "sgd": lambda c, lr: sgd(lr, momentum=c.b1 or None, weight_decay=c.weight_decay),
    "lion": lambda c, lr: lion(lr, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay, mask=decay_mask),
    "adafactor": lambda c, lr: adafactor(lr, weight_decay_rate=c.weight_decay or None, weight_decay_mask=decay_mask),
}
OptimizerName = Literal[(*_OPTIMIZERS, "muon")]  # type: ignore[valid-type]
_MUON_ONLY = ("muon_momentum", "muon_adjust_lr", "adamw_learning_rate")
_UNIT_INTERVAL = Check(lambda v: isinstance(v, (int, float)) and 0 <= v <= 1, "a number in [0, 1]")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule."""

    name: OptimizerName = "adamw"
    """Optimizer alias in ember.optim (muon: Muon for the hidden matrices, AdamW for the rest)."""
    learning_rate: float = 3e-3
    """Peak learning rate (muon: of the Muon group)."""
    schedule: Literal["constant", "cosine", "warmup_cosine", "wsd"] = "warmup_cosine"
    """Learning-rate schedule over `TrainConfig.steps` (wsd: warmup, stable, decay tail)."""
    warmup_steps: int = 20
    """Linear warm-up steps (warmup_cosine and wsd), capped at a tenth of the run."""
    end_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine schedules and wsd)."""
    decay_fraction: float = 0.2
    """wsd: the decay tail's share of the run."""
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "linear"
    """wsd: the decay tail's shape."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied only to matrices (ndim >= 2): no decay on norms, biases (muon: every leaf
    of both groups, as optax's muon and Moonlight)."""
    b1: float = 0.9
    """First-moment decay (adam, adamw, lion, muon's AdamW group) or momentum (sgd)."""
    b2: float = 0.95
    """Second-moment decay (adam, adamw, lion, muon's AdamW group)."""
    eps: float = 1e-8
    """Adam epsilon (muon: also added to each matrix's norm before the Newton-Schulz iteration)."""
    muon_momentum: float = 0.95
    """muon: the Muon group's (Nesterov) momentum."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """muon: each update scaled to AdamW's RMS, 0.2 sqrt(max(fan_in, fan_out)) (one rate serves both groups;
    Moonlight's), or by sqrt(max(1, fan_out / fan_in)) (Keller Jordan's; its rates are ~0.02)."""
    adamw_learning_rate: Optional[float] = None
    """muon: the AdamW group's peak rate, on the same schedule (default: learning_rate)."""
    clip_norm: Optional[float] = 1.0
    """Clip gradients to this global norm; None disables clipping."""

    def __post_init__(self) -> None:
        check_fields(self, "optim.", learning_rate=finite_positive, warmup_steps=non_negative_int,
                     end_lr_ratio=_UNIT_INTERVAL, decay_fraction=_UNIT_INTERVAL, weight_decay=finite_non_negative,
                     b1=fraction, b2=fraction, eps=finite_positive, clip_norm=optional(finite_positive),
                     muon_momentum=fraction, adamw_learning_rate=optional(finite_positive))
        if self.name != "muon":
            given = [f for f in _MUON_ONLY if getattr(self, f) != _DEFAULTS[f]]
            if given:
                raise ValueError(f"optim.{given[0]} is read by Muon only, but optim.name={self.name!r}; drop "
                                 f"--optim.{given[0]} or choose --optim.name muon.")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OptimConfig)}


def schedule_from_config(cfg: OptimConfig, *, total_steps: int, peak: Optional[float] = None) -> Schedule:
    """The learning-rate schedule of `cfg` over a run of `total_steps` steps (to `peak`, default the config's)."""
    peak = cfg.learning_rate if peak is None else peak
    end = peak * cfg.end_lr_ratio
    if cfg.schedule == "constant":
        return constant_schedule(peak)
    if cfg.schedule == "cosine":
        return cosine_decay_schedule(peak, max(total_steps, 1), alpha=cfg.end_lr_ratio)
    warmup = min(cfg.warmup_steps, total_steps // 10)  # short runs (--steps 20) keep a decay phase
    if cfg.schedule == "wsd":
        tail = min(round(total_steps * cfg.decay_fraction), total_steps - warmup)
        return warmup_stable_decay_schedule(peak, warmup, total_steps, tail, end_value=end, decay=cfg.decay_shape)
    return warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, 1), end)


def from_config(cfg: OptimConfig, *, total_steps: int, axes: Optional[PyTree] = None) -> GradientTransformation:
    """`clip_by_global_norm` (if `cfg.clip_norm`) chained with the optimizer alias `cfg.name`.

    Weight decay applies to matrices only (`decay_mask`: no decay on norms and biases). The clip
    norm is a hyperparameter tensor in the state too, so changing it never recompiles. `muon` labels the
    model's hidden matrices from its logical axes (`axes=model.axes`, `muon_labels`).
    """
    if cfg.name not in (*_OPTIMIZERS, "muon"):
        raise ValueError(f"optim.name={cfg.name!r} is not an optimizer; choose one of "
                         f"{', '.join((*_OPTIMIZERS, 'muon'))}.")
    lr = schedule_from_config(cfg, total_steps=total_steps)
    if cfg.name == "muon":
        if axes is None:
            raise ValueError("optim.name='muon' chooses the matrices Muon updates by the model's logical axes; pass "
                             "them: from_config(cfg, total_steps=..., axes=model.axes).")
        adam_lr = schedule_from_config(cfg, total_steps=total_steps, peak=cfg.adamw_learning_rate)
        tx = _muon(cfg, lr, adam_lr, axes)
    else:
        tx = _OPTIMIZERS[cfg.name](cfg, lr)
    if cfg.clip_norm is None:
        return tx
    return chain(inject_hyperparams(clip_by_global_norm)(max_norm=cfg.clip_norm), tx)
