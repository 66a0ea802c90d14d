"""Hyperparameter schedules: pure functions of a 0-d int64 step count returning 0-d float32 tensors.

Public names: `constant_schedule`, `polynomial_schedule`, `linear_schedule`,
`cosine_decay_schedule`, `warmup_cosine_decay_schedule`, `join_schedules`, `warmup_constant_schedule`,
`warmup_stable_decay_schedule` (WSD).

The formulas and edge cases are optax's (`optax/schedules/_schedule.py`, `_join.py`). A schedule
never branches in Python on the count: it uses `torch.clamp` / `torch.where`, so it traces once
under `torch.compile(fullgraph=True)` and torch_xla and the count can live on the device. Pass a
schedule as a hyperparameter (e.g. `adamw(learning_rate=warmup_cosine_decay_schedule(...))`);
`inject_hyperparams` evaluates it at the optimizer's step count inside `update`.

Example:
    >>> import torch
    >>> from ember import optim
    >>> lr = optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=110)
    >>> [round(lr(torch.tensor(t)).item(), 4) for t in (0, 5, 10, 60, 110, 200)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..core.types import Schedule

__all__ = [
    "exponential_decay",
    "constant_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "linear_schedule",
    "polynomial_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_stable_decay_schedule",
]

Number = Union[float, int]


def _as_count(count: Union[Tensor, int]) -> Tensor:
    """Accept a Python int for convenience (REPL use); a tensor passes through untouched."""
    return count if isinstance(count, Tensor) else torch.as_tensor(count, dtype=torch.int64)


def _f32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def constant_schedule(value: Union[Number, Tensor]) -> Schedule:
    """A schedule that always returns `value`.

    Args:
        value: the constant (Python number or 0-d tensor).

    Returns:
        `schedule(count) -> 0-d float32 tensor` on the count's device.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> optim.constant_schedule(0.5)(torch.tensor(7)).item()
        0.5
    """

    def schedule(count: Tensor) -> Tensor:
        count = _as_count(count)
        if isinstance(value, Tensor):
            return value.to(device=count.device, dtype=torch.float32)
        return torch.full((), value, dtype=torch.float32, device=count.device)

    return schedule


def polynomial_schedule(
    init_value: Number,
    end_value: Number,
    *,
    power: Number,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """Go from `init_value` to `end_value` along `(1 - t / transition_steps) ** power`.

    The value is `init_value` before `transition_begin`, `end_value` after
    `transition_begin + transition_steps`, and `(init - end) * (1 - s / T) ** power + end` in
    between (`s` = steps since `transition_begin`, `T` = `transition_steps`).

    Args:
        init_value: the value at the start.
        end_value: the value at the end.
        power: the polynomial's power (1 is linear).
        transition_steps: steps over which the value changes; `<= 0` gives a constant schedule
            at `init_value` (as optax).
        transition_begin: steps to hold `init_value` first; negative values count as 0.

    Returns:
        `schedule(count) -> 0-d float32 tensor`.
    """
    if transition_steps <= 0:
        return constant_schedule(init_value)
    transition_begin = max(int(transition_begin), 0)

    def schedule(count: Tensor) -> Tensor:
        count = _as_count(count)
        steps = torch.clamp(count - transition_begin, 0, transition_steps)
        frac = 1 - _f32(steps) / transition_steps
        return _f32((init_value - end_value) * frac**power + end_value)

    return schedule


def linear_schedule(
    init_value: Number,
    end_value: Number,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """Go linearly from `init_value` to `end_value` over `transition_steps` steps.

    Args:
        init_value: the value at `transition_begin` and before.
        end_value: the value at `transition_begin + transition_steps` and after.
        transition_steps: length of the ramp; `<= 0` gives a constant schedule at `init_value`.
        transition_begin: steps to hold `init_value` before the ramp starts.

    Returns:
        `schedule(count) -> 0-d float32 tensor`.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> warmup = optim.linear_schedule(0.0, 1.0, transition_steps=4)
        >>> [warmup(torch.tensor(t)).item() for t in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    return polynomial_schedule(
        init_value,
        end_value,
        power=1,
        transition_steps=transition_steps,
        transition_begin=transition_begin,
    )


def cosine_decay_schedule(
    init_value: Number,
    decay_steps: int,
    alpha: Number = 0.0,
    *,
    exponent: Number = 1.0,
) -> Schedule:
    """Cosine decay from `init_value` to `alpha * init_value` over `decay_steps` steps.

    `value(t) = init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * min(t, T) / T))) ** exponent
    + alpha)` with `T = decay_steps` (Loshchilov & Hutter, SGDR, 2017).

    Args:
        init_value: the value at step 0.
        decay_steps: steps to reach the floor; must be positive.
        alpha: the floor, as a fraction of `init_value`.
        exponent: power applied to the cosine factor.

    Returns:
        `schedule(count) -> 0-d float32 tensor`.

    Raises:
        ValueError: `decay_steps <= 0`.
    """
    if not decay_steps > 0:
        raise ValueError(
            f"cosine_decay_schedule needs decay_steps > 0, got decay_steps={decay_steps}. "
            f"Pass the number of steps over which to decay (for a constant value use "
            f"constant_schedule)."
        )

    def schedule(count: Tensor) -> Tensor:
        count = _as_count(count)
        t = _f32(torch.clamp(count, max=decay_steps))
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return _f32(init_value * ((1 - alpha) * cosine**exponent + alpha))

    return schedule


def exponential_decay(init_value: Number, transition_steps: int, decay_rate: float, transition_begin: int = 0,
                      staircase: bool = False, end_value: Optional[Number] = None) -> Schedule:
    """`init_value * decay_rate ** ((count - transition_begin) / transition_steps)` (optax's `exponential_decay`).

    `init_value` up to `transition_begin`; with `staircase` the exponent is floored (a drop every
    `transition_steps`); `end_value` bounds the decay (a floor when `decay_rate < 1`, a ceiling above 1).
    `transition_steps <= 0` or `decay_rate == 0` gives a constant schedule at `init_value`.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> s = optim.exponential_decay(1.0, transition_steps=2, decay_rate=0.5, staircase=True)
        >>> [s(torch.tensor(t)).item() for t in (0, 1, 2, 4)]
        [1.0, 1.0, 0.5, 0.25]
    """
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    begin = max(transition_begin, 0)

    def schedule(count: Tensor) -> Tensor:
        count = _as_count(count)
        since = (count - begin).to(torch.float32)
        p = since / transition_steps
        if staircase:
            p = torch.floor(p)
        value = torch.where(since <= 0, init_value, init_value * torch.pow(torch.tensor(decay_rate, dtype=torch.float32,
                                                                                         device=count.device), p))
        if end_value is not None:
            value = (torch.clamp_min if decay_rate < 1.0 else torch.clamp_max)(value, end_value)
        return _f32(value)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run `schedules[i]` from `boundaries[i-1]` on, each seeing the steps since its boundary.

    Args:
        schedules: the schedules, in order.
        boundaries: `len(schedules) - 1` increasing step counts where the next schedule starts.

    Returns:
        `schedule(count) -> 0-d float32 tensor`.

    Raises:
        ValueError: the number of boundaries is not `len(schedules) - 1`.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> s = optim.join_schedules(
        ...     [optim.constant_schedule(1.0), optim.linear_schedule(1.0, 0.0, 10)], [5])
        >>> [s(torch.tensor(t)).item() for t in (0, 4, 5, 10, 15)]
        [1.0, 1.0, 1.0, 0.5, 0.0]
    """
    schedules, boundaries = list(schedules), [int(b) for b in boundaries]
    if not schedules or len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules needs len(boundaries) == len(schedules) - 1, got {len(schedules)} "
            f"schedules and {len(boundaries)} boundaries ({boundaries}). Give one boundary "
            f"(the step where the next schedule starts) between each pair of schedules."
        )

    def schedule(count: Tensor) -> Tensor:
        count = _as_count(count)
        out = schedules[0](count)
        for boundary, nxt in zip(boundaries, schedules[1:]):
            out = torch.where(count < boundary, out, nxt(count - boundary))
        return out

    return schedule


def warmup_cosine_decay_schedule(
    init_value: Number,
    peak_value: Number,
    warmup_steps: int,
    decay_steps: int,
    end_value: Number = 0.0,
    *,
    exponent: Number = 1.0,
) -> Schedule:
    """Linear warmup from `init_value` to `peak_value`, then cosine decay to `end_value`.

    Args:
        init_value: the value at step 0.
        peak_value: the value at the end of warmup.
        warmup_steps: length of the linear warmup.
        decay_steps: total length of the schedule, warmup included (the cosine part lasts
            `decay_steps - warmup_steps`, which must be positive).
        end_value: the value from `decay_steps` on.
        exponent: power applied to the cosine factor.

    Returns:
        `schedule(count) -> 0-d float32 tensor`.

    Raises:
        ValueError: `decay_steps <= warmup_steps`.
    """
    if not decay_steps > warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay_schedule needs decay_steps > warmup_steps (decay_steps counts "
            f"the warmup too), got warmup_steps={warmup_steps}, decay_steps={decay_steps}. "
            f"Set decay_steps to the total number of training steps."
        )
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent=exponent),
        ],
        [warmup_steps],
    )


def warmup_constant_schedule(init_value: Number, peak_value: Number, warmup_steps: int) -> Schedule:
    """Linear warmup from `init_value` to `peak_value` over `warmup_steps`, then `peak_value` (optax's).

    Example:
        >>> import torch
        >>> s = warmup_constant_schedule(0.0, 1.0, warmup_steps=4)
        >>> [s(torch.tensor(t)).item() for t in (0, 2, 4, 100)]
        [0.0, 0.5, 1.0, 1.0]
    """
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps), constant_schedule(peak_value)],
                          [warmup_steps])


_DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def warmup_stable_decay_schedule(
    peak_value: Number,
    warmup_steps: int,
    total_steps: int,
    decay_steps: int,
    *,
    init_value: Number = 0.0,
    end_value: Number = 0.0,
    decay: str = "linear",
) -> Schedule:
    """Warmup-stable-decay (WSD): a linear warmup to `peak_value`, the peak held, then a decay tail of the
    last `decay_steps` steps to `end_value`, shaped `"linear"`, `"cosine"` or `"1-sqrt"` (the cooldown of
    Hägele et al., 2024: `1 - sqrt(s)` of the tail's fraction `s`).

    Args:
        peak_value: the value after warmup and through the stable phase.
        warmup_steps: length of the linear warmup from `init_value`.
        total_steps: length of the run; the tail ends here and `end_value` holds after it.
        decay_steps: length of the tail (e.g. a fifth of `total_steps`).
        init_value: the value at step 0.
        end_value: the value at `total_steps` and after.
        decay: the tail's shape, `"linear"`, `"cosine"` or `"1-sqrt"`.

    Returns:
        `schedule(count) -> 0-d float32 tensor`.

    Raises:
        ValueError: an unknown `decay`, or `warmup_steps + decay_steps > total_steps`.

    Example:
        >>> import torch
        >>> s = warmup_stable_decay_schedule(1.0, warmup_steps=2, total_steps=10, decay_steps=4, decay="1-sqrt")
        >>> [round(s(torch.tensor(t)).item(), 4) for t in (0, 1, 2, 6, 7, 10, 12)]
        [0.0, 0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    """
    if decay not in _DECAY_SHAPES:
        raise ValueError(f"warmup_stable_decay_schedule: decay={decay!r} is not a tail shape; choose one of "
                         f"{', '.join(_DECAY_SHAPES)}.")
    if min(warmup_steps, decay_steps) < 0 or warmup_steps + decay_steps > total_steps:
        raise ValueError(
            f"warmup_stable_decay_schedule needs 0 <= warmup_steps + decay_steps <= total_steps (the warmup and "
            f"the tail both fit in the run), got warmup_steps={warmup_steps}, decay_steps={decay_steps}, "
            f"total_steps={total_steps}. Shorten the warmup or the tail (decay_steps ~ total_steps / 5).")

    def tail(count: Tensor) -> Tensor:
        s = torch.clamp(_f32(count) / max(decay_steps, 1), 0.0, 1.0)
        left = {"linear": lambda: 1.0 - s, "cosine": lambda: 0.5 * (1.0 + torch.cos(math.pi * s)),
                "1-sqrt": lambda: 1.0 - torch.sqrt(s)}[decay]()
        return end_value + (peak_value - end_value) * left

    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps), constant_schedule(peak_value),
                           tail], [warmup_steps, total_steps - decay_steps])
