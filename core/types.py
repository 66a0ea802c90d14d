"""Domain type aliases shared by every part of ember.

Public names: `PyTree`, `Params`, `Updates`, `OptState`, `Key`, `Metrics`, `Batch`,
`LogicalAxes`, `Schedule`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from torch import Tensor

PyTree = Any
"""Nested dict / list / tuple / registered dataclass with `torch.Tensor` leaves."""

Params = PyTree
"""Model parameters: a pytree of floating-point tensors."""

Updates = PyTree
"""Gradients or updates: same structure as `Params`."""

OptState = PyTree
"""Optimizer state: a pytree of tensors (hyperparameters included, as 0-d tensors)."""

Key = Tensor
"""A counter-based RNG key: a 0-d int64 tensor (see `ember.core.random`)."""

Metrics = Dict[str, Tensor]
"""Metrics returned by a step: a flat dict of 0-d tensors, kept on device until logged."""

Batch = PyTree
"""A batch of inputs: a pytree of tensors whose leading dimension is the batch."""

LogicalAxes = Tuple[Optional[str], ...]
"""Logical axis names for each dimension of one parameter, e.g. `("embed", "mlp")`."""

Schedule = Callable[[Tensor], Tensor]
"""A hyperparameter schedule: 0-d int64 step count -> 0-d float32 tensor."""
