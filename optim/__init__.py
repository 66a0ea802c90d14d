"""ember.optim: optax-style gradient transformations on flat `torch._foreach_*` math.

A `GradientTransformation` is a pair of pure functions `init(params) -> state` and
`update(updates, state, params=None) -> (updates, state)`; `apply_updates(params, updates)` adds
the result. Building blocks (`scale_by_adam`, `clip_by_global_norm`, `add_decayed_weights`,
`trace`, ...) compose with `chain` and `masked`; the aliases (`adamw`, `adam`, `sgd`, `lion`,
`adafactor`) are such chains wrapped in `inject_hyperparams`, so their hyperparameters are 0-d
float32 tensors in the state: `set_hyperparams(opt_state, learning_rate=...)` never recompiles a
compiled step. Schedules are pure functions of a 0-d int64 count. `from_config` builds the
optimizer of a run config (`OptimConfig`).

Everything is out of place and traces whole under `torch.compile(fullgraph=True)` and torch_xla,
and works on DTensor params.

Public names, by module:
- base: `GradientTransformation`, `TransformInitFn`, `TransformUpdateFn`, `ScalarOrSchedule`,
  `EmptyState`, `MaskedNode`, `identity`, `apply_updates`; combining: `chain`.
- hyperparams: `inject_hyperparams`, `InjectHyperparamsState`, `set_hyperparams`,
  `get_hyperparams`.
- schedules: `constant_schedule`, `linear_schedule`, `polynomial_schedule`,
  `cosine_decay_schedule`, `warmup_cosine_decay_schedule`, `join_schedules`,
  `warmup_constant_schedule`, `warmup_stable_decay_schedule`, `exponential_decay`.
- building blocks: `clip`, `clip_by_global_norm`, `clip_by_block_rms` (clipping); `scale_by_rms`,
  `ScaleByRmsState`, `zero_nans`, `ZeroNansState` (rms); `masked`, `MaskedState`,
  `decay_mask` (masking); `add_decayed_weights` (weight_decay); `scale`, `scale_by_learning_rate`, `scale_by_schedule`, `ScaleByScheduleState` (scaling);
  `scale_by_adam`, `ScaleByAdamState` (adam); `trace`, `TraceState`, `ema`, `EmaState`
  (momentum); `scale_by_lion`, `ScaleByLionState` (lion); `scale_by_factored_rms`,
  `ScaleByFactoredRmsState`, `scale_by_param_block_rms` (adafactor).
- `partition`, `PartitionState` (parameter groups, each its own transformation);
  `multi_steps`, `MultiSteps`, `MultiStepsState` (gradient accumulation); `apply_if_finite`,
  `ApplyIfFiniteState` (skip non-finite gradients); `global_norm` (clipping).
- muon: `muon`, `scale_by_muon`, `scale_by_shape`, `orthogonalize_via_newton_schulz`,
  `MuonDimensionNumbers`, `ScaleByMuonState`, `muon_labels`.
- schedule_free: `schedule_free`, `schedule_free_adamw`, `schedule_free_eval_params`, `ScheduleFreeState`
  (optax.contrib's).
- aliases: `adamw`, `adam`, `sgd`, `lion`, `adafactor`; config: `OptimConfig`, `from_config`,
  `schedule_from_config`.

Example:
    >>> import torch
    >>> from ember import optim
    >>> params = {"w": torch.ones(3, 3), "b": torch.zeros(3)}
    >>> lr = optim.warmup_cosine_decay_schedule(0.0, 3e-4, warmup_steps=100, decay_steps=1000)
    >>> tx = optim.chain(optim.clip_by_global_norm(1.0),
    ...                  optim.adamw(lr, weight_decay=0.1, mask=optim.decay_mask))
    >>> state = tx.init(params)
    >>> grads = {"w": torch.ones(3, 3), "b": torch.ones(3)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optim.apply_updates(params, updates)
    >>> state = optim.set_hyperparams(state, weight_decay=0.05)
"""

from .adafactor import ScaleByFactoredRmsState as ScaleByFactoredRmsState
from .adafactor import scale_by_factored_rms as scale_by_factored_rms
from .adafactor import scale_by_param_block_rms as scale_by_param_block_rms
from .adam import ScaleByAdamState as ScaleByAdamState
from .adam import scale_by_adam as scale_by_adam
from .adafactor import adafactor as adafactor
from .aliases import adam as adam
from .aliases import adamw as adamw
from .aliases import lion as lion
from .aliases import sgd as sgd
from .base import EmptyState as EmptyState
from .base import GradientTransformation as GradientTransformation
from .base import MaskedNode as MaskedNode
from .base import ScalarOrSchedule as ScalarOrSchedule
from .base import TransformInitFn as TransformInitFn
from .base import TransformUpdateFn as TransformUpdateFn
from .base import apply_updates as apply_updates
from .base import identity as identity
from .base import stateless as stateless
from .clipping import clip as clip
from .clipping import clip_by_block_rms as clip_by_block_rms
from .clipping import clip_by_global_norm as clip_by_global_norm
from .clipping import global_norm as global_norm
from .combining import chain as chain
from .conditionality import ApplyIfFiniteState as ApplyIfFiniteState
from .conditionality import apply_if_finite as apply_if_finite
from .config import OptimConfig as OptimConfig
from .config import from_config as from_config
from .config import schedule_from_config as schedule_from_config
from .hyperparams import InjectHyperparamsState as InjectHyperparamsState
from .hyperparams import get_hyperparams as get_hyperparams
from .hyperparams import inject_hyperparams as inject_hyperparams
from .hyperparams import set_hyperparams as set_hyperparams
from .lion import ScaleByLionState as ScaleByLionState
from .lion import scale_by_lion as scale_by_lion
from .masking import MaskedState as MaskedState
from .masking import decay_mask as decay_mask
from .masking import masked as masked
from .momentum import EmaState as EmaState
from .momentum import TraceState as TraceState
from .momentum import ema as ema
from .momentum import trace as trace
from .multi_steps import MultiSteps as MultiSteps
from .multi_steps import MultiStepsState as MultiStepsState
from .multi_steps import multi_steps as multi_steps
from .scaling import ScaleByScheduleState as ScaleByScheduleState
from .scaling import scale as scale
from .scaling import scale_by_learning_rate as scale_by_learning_rate
from .scaling import scale_by_schedule as scale_by_schedule
from .muon import MuonDimensionNumbers as MuonDimensionNumbers
from .muon import ScaleByMuonState as ScaleByMuonState
from .muon import muon as muon
from .muon import muon_labels as muon_labels
from .muon import orthogonalize_via_newton_schulz as orthogonalize_via_newton_schulz
from .muon import scale_by_muon as scale_by_muon
from .muon import scale_by_shape as scale_by_shape
from .partition import PartitionState as PartitionState
from .partition import partition as partition
from .rms import ScaleByRmsState as ScaleByRmsState
from .rms import ZeroNansState as ZeroNansState
from .rms import scale_by_rms as scale_by_rms
from .rms import zero_nans as zero_nans
from .schedule_free import ScheduleFreeState as ScheduleFreeState
from .schedule_free import schedule_free as schedule_free
from .schedule_free import schedule_free_adamw as schedule_free_adamw
from .schedule_free import schedule_free_eval_params as schedule_free_eval_params
from .schedules import constant_schedule as constant_schedule
from .schedules import exponential_decay as exponential_decay
from .schedules import cosine_decay_schedule as cosine_decay_schedule
from .schedules import join_schedules as join_schedules
from .schedules import linear_schedule as linear_schedule
from .schedules import polynomial_schedule as polynomial_schedule
from .schedules import warmup_constant_schedule as warmup_constant_schedule
from .schedules import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from .schedules import warmup_stable_decay_schedule as warmup_stable_decay_schedule
from .weight_decay import add_decayed_weights as add_decayed_weights

__all__ = [
    "ApplyIfFiniteState",
    "EmaState",
    "EmptyState",
    "GradientTransformation",
    "InjectHyperparamsState",
    "MaskedNode",
    "MaskedState",
    "MultiSteps",
    "MultiStepsState",
    "MuonDimensionNumbers",
    "OptimConfig",
    "PartitionState",
    "ScalarOrSchedule",
    "ScaleByAdamState",
    "ScaleByFactoredRmsState",
    "ScaleByLionState",
    "ScaleByMuonState",
    "ScaleByRmsState",
    "ScaleByScheduleState",
    "ScheduleFreeState",
    "TraceState",
    "TransformInitFn",
    "TransformUpdateFn",
    "ZeroNansState",
    "adafactor",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "decay_mask",
    "ema",
    "exponential_decay",
    "from_config",
    "get_hyperparams",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "join_schedules",
    "linear_schedule",
    "lion",
    "masked",
    "multi_steps",
    "muon",
    "muon_labels",
    "orthogonalize_via_newton_schulz",
    "partition",
    "polynomial_schedule",
    "scale",
    "scale_by_adam",
    "scale_by_factored_rms",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_muon",
    "scale_by_param_block_rms",
    "scale_by_rms",
    "scale_by_schedule",
    "scale_by_shape",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_from_config",
    "set_hyperparams",
    "sgd",
    "stateless",
    "trace",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_stable_decay_schedule",
    "zero_nans",
]

_REMOVED = ("balance_experts", "sign_of_load", "expert_bias_mask")
"""Names of the expert-bias wrapper, removed when `train_step` took the bias over (no wrapping needed)."""


def __getattr__(name: str):
    if name in _REMOVED:
        raise AttributeError(
            f"ember.optim.{name} was removed: train_step moves the routers' expert biases by their load itself "
            f"(at the model's expert_bias_update_rate), whatever the optimizer; pass the optimizer unwrapped.")
    from ._optax_names import missing_name_message  # optax's names ember lacks: what it has instead

    raise AttributeError(missing_name_message(name, __all__))
