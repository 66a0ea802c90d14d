"""Parameter initializers: pure functions of an ember key, a shape and a dtype.

Public names: `Initializer`, `constant`, `zeros`, `ones`, `normal`, `truncated_normal`, `uniform`,
`variance_scaling`, `lecun_normal`, `glorot_uniform`, `he_normal`, `scaled`.

An initializer is any callable `init(key, shape, dtype) -> Tensor`. The ones here are small frozen
dataclasses, so two layers built with the same hyperparameters compare (and hash) equal. Every
random draw comes from `ember.core.random`, so the same key gives the same parameters on any
backend; the tensor lands on the key's device (a key on `"meta"` gives meta tensors).

Fan-based initializers assume torch's weight layout: `(out_features, in_features)` for a linear
weight, so `in_axis=-1` and `out_axis=-2` by default; remaining dims form the receptive field.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import initializers as inits
    >>> w = inits.normal(0.02)(random.key(0), (4, 8), torch.float32)
    >>> w.shape, w.dtype
    (torch.Size([4, 8]), torch.float32)
    >>> inits.zeros()(random.key(0), (3,), torch.bfloat16).tolist()
    [0.0, 0.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Protocol, Sequence, Tuple

import torch
from torch import Tensor

from ...core import random
from ...core.types import Key

__all__ = [
    "Initializer",
    "constant",
    "glorot_uniform",
    "he_normal",
    "lecun_normal",
    "normal",
    "ones",
    "scaled",
    "truncated_normal",
    "uniform",
    "variance_scaling",
]

FanMode = Literal["fan_in", "fan_out", "fan_avg"]
Distribution = Literal["normal", "truncated_normal", "uniform"]
_FAN_MODES = ("fan_in", "fan_out", "fan_avg")
_DISTRIBUTIONS = ("normal", "truncated_normal", "uniform")

# Standard deviation of a unit normal truncated to [-2, 2]; dividing by it makes a truncated
# normal draw have the requested variance (same constant as jax.nn.initializers.variance_scaling).
_TRUNC_2_STD = 0.87962566103423978


class Initializer(Protocol):
    """`init(key, shape, dtype) -> Tensor` of exactly `shape` and `dtype`, on the key's device."""

    def __call__(self, key: Key, shape: Tuple[int, ...], dtype: torch.dtype) -> Tensor: ...


@dataclasses.dataclass(frozen=True)
class _Constant:
    value: float

    def __call__(self, key: Key, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        return torch.full(tuple(shape), self.value, dtype=dtype, device=key.device)


@dataclasses.dataclass(frozen=True)
class _Normal:
    stddev: float
    mean: float

    def __call__(self, key: Key, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        x = random.normal(key, tuple(shape), dtype=torch.float32) * self.stddev + self.mean
        return x.to(dtype)


@dataclasses.dataclass(frozen=True)
class _TruncatedNormal:
    stddev: float
    lower: float
    upper: float

    def __call__(self, key: Key, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        # Inverse-CDF sampling restricted to [Phi(lower), Phi(upper)], then scaled by stddev.
        cdf_lo = 0.5 * (1.0 + math.erf(self.lower / math.sqrt(2.0)))
        cdf_hi = 0.5 * (1.0 + math.erf(self.upper / math.sqrt(2.0)))
        u = random.uniform(key, tuple(shape), minval=cdf_lo, maxval=cdf_hi)
        z = math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0)
        return (z.clamp(self.lower, self.upper) * self.stddev).to(dtype)


@dataclasses.dataclass(frozen=True)
class _Uniform:
    minval: float
    maxval: float

    def __call__(self, key: Key, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        x = random.uniform(key, tuple(shape), minval=self.minval, maxval=self.maxval)
        return x.to(dtype)


def _fans(shape: Tuple[int, ...], in_axis: int, out_axis: int) -> Tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    n = len(shape)
    ia, oa = in_axis % n, out_axis % n
    receptive = math.prod(d for i, d in enumerate(shape) if i not in (ia, oa))
    return shape[ia] * receptive, shape[oa] * receptive


@dataclasses.dataclass(frozen=True)
class _VarianceScaling:
    scale: float
    mode: str
    distribution: str
    in_axis: int
    out_axis: int

    def __call__(self, key: Key, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        fan_in, fan_out = _fans(tuple(shape), self.in_axis, self.out_axis)
        fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[self.mode]
        variance = self.scale / max(1.0, fan)
        if self.distribution == "normal":
            return _Normal(math.sqrt(variance), 0.0)(key, shape, dtype)
        if self.distribution == "truncated_normal":
            return _TruncatedNormal(math.sqrt(variance) / _TRUNC_2_STD, -2.0, 2.0)(key, shape, dtype)
        limit = math.sqrt(3.0 * variance)
        return _Uniform(-limit, limit)(key, shape, dtype)


@dataclasses.dataclass(frozen=True)
class _Scaled:
    init: Initializer
    factor: float

    def __call__(self, key: Key, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        return (self.init(key, shape, torch.float32) * self.factor).to(dtype)


def constant(value: float) -> Initializer:
    """Every element equal to `value`."""
    return _Constant(float(value))


def zeros() -> Initializer:
    """All zeros (biases, LayerNorm shift)."""
    return _Constant(0.0)


def ones() -> Initializer:
    """All ones (norm scales)."""
    return _Constant(1.0)


def normal(stddev: float = 1.0, *, mean: float = 0.0) -> Initializer:
    """Gaussian with standard deviation `stddev` (GPT-2 and Llama use 0.02).

    Raises:
        ValueError: if `stddev` is negative.
    """
    if stddev < 0:
        raise ValueError(f"normal(stddev) needs stddev >= 0, got {stddev}.")
    return _Normal(float(stddev), float(mean))


def truncated_normal(stddev: float = 1.0, *, lower: float = -2.0, upper: float = 2.0) -> Initializer:
    """Gaussian with scale `stddev`, truncated to `[lower, upper]` standard deviations.

    Raises:
        ValueError: if `stddev` is negative or `lower >= upper`.
    """
    if stddev < 0 or lower >= upper:
        raise ValueError(
            f"truncated_normal needs stddev >= 0 and lower < upper, got stddev={stddev}, "
            f"lower={lower}, upper={upper}."
        )
    return _TruncatedNormal(float(stddev), float(lower), float(upper))


def uniform(minval: float = 0.0, maxval: float = 1.0) -> Initializer:
    """Uniform in `[minval, maxval)`.

    Raises:
        ValueError: if `minval > maxval`.
    """
    if minval > maxval:
        raise ValueError(f"uniform needs minval <= maxval, got minval={minval}, maxval={maxval}.")
    return _Uniform(float(minval), float(maxval))


def variance_scaling(
    scale: float,
    mode: FanMode = "fan_in",
    distribution: Distribution = "truncated_normal",
    *,
    in_axis: int = -1,
    out_axis: int = -2,
) -> Initializer:
    """Draws with variance `scale / fan`, where `fan` is chosen by `mode` (He et al. 2015, §2.2).

    Args:
        scale: variance multiplier (1.0 for LeCun, 2.0 for He).
        mode: which fan divides the variance: "fan_in", "fan_out" or "fan_avg".
        distribution: "normal", "truncated_normal" (rescaled to keep the variance) or "uniform".
        in_axis: dimension holding the input features (torch layout: last).
        out_axis: dimension holding the output features (torch layout: second to last).

    Returns:
        The initializer.

    Raises:
        ValueError: for an unknown `mode` or `distribution`, listing the valid ones.
    """
    if mode not in _FAN_MODES:
        raise ValueError(f"variance_scaling mode must be one of {_FAN_MODES}, got {mode!r}.")
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(
            f"variance_scaling distribution must be one of {_DISTRIBUTIONS}, got {distribution!r}."
        )
    return _VarianceScaling(float(scale), mode, distribution, in_axis, out_axis)


def lecun_normal() -> Initializer:
    """Truncated normal with variance `1 / fan_in` (LeCun et al. 1998; Flax's Dense default)."""
    return variance_scaling(1.0, "fan_in", "truncated_normal")


def glorot_uniform() -> Initializer:
    """Uniform with variance `1 / fan_avg` (Glorot & Bengio 2010, eq. 16)."""
    return variance_scaling(1.0, "fan_avg", "uniform")


def he_normal() -> Initializer:
    """Truncated normal with variance `2 / fan_in` (He et al. 2015, for ReLU networks)."""
    return variance_scaling(2.0, "fan_in", "truncated_normal")


def scaled(init: Initializer, factor: float) -> Initializer:
    """`init` multiplied by `factor`, e.g. GPT-2's residual projections `scaled(normal(0.02), 1/sqrt(2L))`."""
    if not callable(init):
        raise TypeError(f"scaled(init, factor) needs a callable initializer, got {type(init).__name__}.")
    return _Scaled(init, float(factor))
