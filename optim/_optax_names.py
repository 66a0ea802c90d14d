"""What `ember.optim.<name>` says when `name` is an optax name ember lacks: the nearest names it has.

Private to `ember.optim` (its module `__getattr__` raises `AttributeError(missing_name_message(name))`).
Each group is the optax names a user reaches for and the ember names that do that job, or the recipe.
"""

from __future__ import annotations

import difflib
from typing import Dict, Sequence, Tuple

_OPTIMIZERS = ("ember's optimizers are adamw, adam, sgd, lion, adafactor, muon and schedule_free_adamw (or chain(...) "
               "its building blocks)")
_SCHEDULES = ("ember's schedules are constant_schedule, linear_schedule, polynomial_schedule, cosine_decay_schedule, "
              "warmup_cosine_decay_schedule, warmup_constant_schedule, warmup_stable_decay_schedule, exponential_decay "
              "and join_schedules")
_GROUPS: Tuple[Tuple[str, str], ...] = (
    ("adabelief adadelta adagrad adamax adamaxw adan amsgrad fromage lamb lars lbfgs nadam nadamw noisy_sgd novograd "
     "optimistic_adam optimistic_adam_v2 optimistic_gradient_descent polyak_sgd radam rmsprop rprop sign_sgd signum "
     "sm3 yogi", f"an optimizer ember.optim does not have yet; {_OPTIMIZERS}"),
    ("piecewise_constant_schedule piecewise_interpolate_schedule cosine_onecycle_schedule "
     "linear_onecycle_schedule sgdr_schedule warmup_exponential_decay_schedule",
     f"a schedule ember.optim does not have; {_SCHEDULES} (a schedule is any function of the step count)"),
    ("adaptive_grad_clip per_example_global_norm_clip per_example_layer_norm_clip",
     "a clipping ember.optim does not have; ember's are clip, clip_by_global_norm and clip_by_block_rms"),
    ("skip_not_finite skip_large_updates",
     "ember.optim handles non-finite gradients with apply_if_finite(inner, max_consecutive_errors), which skips "
     "the update of a step whose gradients are not finite"),
    ("multi_transform", "ember.optim's is partition(transforms, param_labels), optax's newer name for it"),
    ("freeze set_to_zero selective_transform",
     "ember.optim freezes or selects parameters with partition({'train': tx, 'frozen': scale(0.0)}, labels) or "
     "masked(inner, mask) (a pytree of bools, or a function of the params)"),
    ("apply_every", "ember.optim accumulates gradients with multi_steps / MultiSteps(inner, every_k_schedule)"),
    ("inject_stateful_hyperparams", "ember.optim's is inject_hyperparams (set_hyperparams changes a value)"),
    ("named_chain lookahead", "ember.optim composes transformations with chain"),
    ("scale_by_stddev scale_by_sign scale_by_trust_ratio scale_by_belief scale_by_radam "
     "scale_by_amsgrad scale_by_novograd scale_by_yogi scale_by_sm3 scale_by_adamax scale_by_adadelta scale_by_adan "
     "scale_by_rss scale_by_rprop scale_by_polyak scale_by_lbfgs scale_by_optimistic_gradient "
     "scale_by_param_block_norm scale_by_distance_over_gradients scale_gradient",
     "a scaling ember.optim does not have; ember's are scale, scale_by_adam, scale_by_rms, scale_by_lion, "
     "scale_by_factored_rms, "
     "scale_by_param_block_rms, scale_by_learning_rate and scale_by_schedule"),
    ("contrib experimental second_order projections perturbations assignment microbatching monitor",
     "an optax namespace ember.optim does not mirror; " + _OPTIMIZERS),
    ("schedules transforms", "ember.optim keeps these at the top level (ember.optim.cosine_decay_schedule, "
                             "ember.optim.clip_by_global_norm, ...), not in a submodule"),
    ("losses softmax_cross_entropy softmax_cross_entropy_with_integer_labels",
     "losses are not in ember.optim: ember.core.step_fns.cross_entropy, and ember.models.lm_loss(model) for a "
     "language model"),
    ("tree_utils tree", "tree helpers are ember.core.tree_math (tree_add, tree_scale, ...) and ember.core.pytree "
                        "(tree_map, tree_leaves, ...)"),
)
_ABOUT: Dict[str, str] = {name: say for names, say in _GROUPS for name in names.split()}


def missing_name_message(name: str, names: Sequence[str]) -> str:
    """The `AttributeError` text for `ember.optim.<name>`; `names` is `ember.optim.__all__`."""
    plain = f"module 'ember.optim' has no attribute {name!r}"
    if name.startswith("_"):
        return plain
    if name in _ABOUT:
        return f"{plain} (an optax name): {_ABOUT[name]}."
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"{plain}; {hint}`ember.optim.__all__` lists every name."
