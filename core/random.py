"""Counter-based random keys, JAX-style, built from int64 tensor ops so they trace everywhere.

Public names: `key`, `PRNGKey` (JAX's legacy name of `key`), `split`, `fold_in`, `bits`, `uniform`,
`normal`, `gumbel`, `bernoulli`, `categorical`, `dropout`, `randint`, `permutation`.

A key is a 0-d int64 tensor. Every random function is a pure function of its key: the same key
gives the same numbers eagerly, under `torch.compile(fullgraph=True)` and under torch_xla (on the
same backend). `torch.Generator` and the global RNG are never touched, so a step that takes its
key from the train state is a pure function of its inputs and a resumed run is bit-identical.

The mixer is splitmix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number generators",
OOPSLA 2014) over wrapping int64 arithmetic; logical right shifts are emulated (see `_srl`) because torch's
`>>` on a negative int64 is arithmetic on CPU and a rounding division on torch_xla. Counters are added to the key *before* any multiplication:
torch 2.9's CPU Inductor miscompiles `arange(n, dtype=int64) * <64-bit constant>` (it folds the
product into an index expression that overflows), giving wrong values and heap corruption for
sizes that are not a multiple of the vector width.

Example:
    >>> from ember.core import random
    >>> k = random.key(0)
    >>> k1, k2 = random.split(k)
    >>> random.normal(k1, (2, 3)).shape
    torch.Size([2, 3])
    >>> bool((random.uniform(k2, (4,)) == random.uniform(k2, (4,))).all())
    True
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .types import Key

__all__ = [
    "PRNGKey",
    "bernoulli",
    "bits",
    "categorical",
    "dropout",
    "fold_in",
    "gumbel",
    "key",
    "normal",
    "permutation",
    "randint",
    "split",
    "uniform",
]


def _s64(x: int) -> int:
    """Reinterpret an unsigned 64-bit constant as signed int64."""
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)
_SPLIT_SALT = _s64(0xD1B54A32D192ED03)
_FOLD_SALT = _s64(0x8CB92BA72F3D8DD7)


_INT64_MAX = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


def _srl(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 by `s` bits.

    Only non-negative values are ever shifted right: torch_xla lowers `>>` on a negative int64 as
    a division rounding toward zero, CPU as an arithmetic shift. The sign bit is moved by hand.
    """
    low = (x & _INT64_MAX) >> s
    high = (x < 0).to(torch.int64) << (63 - s)
    return low | high


def _mix(z: Tensor) -> Tensor:
    """splitmix64 finaliser: a bijection on 64-bit integers with good avalanche."""
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def _check_key(k: Tensor, fn: str) -> None:
    if not isinstance(k, Tensor) or k.dtype != torch.int64:
        got = f"{type(k).__name__}" if not isinstance(k, Tensor) else f"tensor of dtype {k.dtype}"
        raise TypeError(
            f"{fn} expects a key made by ember.core.random.key(seed) (0-d int64 tensor), got {got}. "
            f"Create one with `key = ember.random.key(0)` and pass it down the call."
        )


def key(seed: Union[int, Tensor], *, device: Optional[torch.device | str] = None) -> Key:
    """A new key from an integer seed (a 0-d int64 tensor)."""
    if isinstance(seed, Tensor):
        return _mix(seed.to(torch.int64) + _GOLDEN)
    return _mix(torch.tensor(seed, dtype=torch.int64, device=device) + _GOLDEN)


def PRNGKey(seed: Union[int, Tensor], *, device: Optional[torch.device | str] = None) -> Key:  # noqa: N802
    """JAX's legacy name of `key`: the same key, `PRNGKey(0)` equals `key(0)`."""
    return key(seed, device=device)


def split(k: Key, num: int = 2) -> Tensor:
    """`num` independent keys derived from `k`, stacked as a `(num,)` int64 tensor.

    Unpack them like JAX keys: `k1, k2 = split(k)`.
    """
    _check_key(k, "split")
    counters = torch.arange(1, num + 1, dtype=torch.int64, device=k.device)
    return _mix(_mix(counters + k) ^ _SPLIT_SALT)


def _mix_int(z: int) -> int:
    """`_mix` on a Python int (64-bit wrapping arithmetic): the same bits, no tensor constant in a traced graph."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * (_MIX1 & _MASK64)) & _MASK64
    z = ((z ^ (z >> 27)) * (_MIX2 & _MASK64)) & _MASK64
    return _s64(z ^ (z >> 31))


def fold_in(k: Key, data: Union[int, Tensor]) -> Key:
    """A new key from `k` and an integer (a step count, a layer index, a rank)."""
    _check_key(k, "fold_in")
    if not isinstance(data, Tensor):
        if not -(1 << 63) <= int(data) <= _INT64_MAX:
            raise ValueError(f"fold_in(data={data}) must fit in int64; fold in a smaller integer.")
        return _mix(k ^ _mix_int(int(data) * _GOLDEN + _FOLD_SALT))
    return _mix(k ^ _mix(data.to(torch.int64) * _GOLDEN + _FOLD_SALT))


def bits(k: Key, shape: Sequence[int]) -> Tensor:
    """Uniform random int64 bit patterns of `shape` (counter mode: element i hashes (key, i))."""
    _check_key(k, "bits")
    n = math.prod(shape)
    counters = torch.arange(n, dtype=torch.int64, device=k.device)
    return _mix(_mix(counters + k) + _GOLDEN).reshape(tuple(shape))


def uniform(
    k: Key,
    shape: Sequence[int] = (),
    *,
    dtype: torch.dtype = torch.float32,
    minval: float = 0.0,
    maxval: float = 1.0,
) -> Tensor:
    """Uniform floats in `[minval, maxval)` (24 random bits; 53 for float64)."""
    b = bits(k, shape)
    if dtype == torch.float64:
        u = _srl(b, 11).to(torch.float64) * (2.0**-53)
    else:
        u = _srl(b, 40).to(torch.float32) * (2.0**-24)
    u = u * (maxval - minval) + minval
    return u.to(dtype)


def normal(k: Key, shape: Sequence[int] = (), *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard normal samples by inverse-CDF: `sqrt(2) * erfinv(2u - 1)`, u in the open (0, 1).

    `u = (m + 0.5) / 2**p` with p = 23 (52 for float64) random bits, so `u` stays strictly inside
    (0, 1) after rounding: with p = 24 the top value rounds to 1.0 in float32 and gives inf.
    """
    b = bits(k, shape)
    if dtype == torch.float64:
        u = (_srl(b, 12).to(torch.float64) + 0.5) * (2.0**-52)
        work = torch.float64
    else:
        u = (_srl(b, 41).to(torch.float32) + 0.5) * (2.0**-23)
        work = torch.float32
    return (math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0)).to(work).to(dtype)


def gumbel(k: Key, shape: Sequence[int] = (), *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard Gumbel samples, `-log(-log(u))` with u in the open (0, 1) (23 random bits; 52 for float64)."""
    b = bits(k, shape)
    if dtype == torch.float64:
        u = (_srl(b, 12).to(torch.float64) + 0.5) * (2.0**-52)
    else:
        u = (_srl(b, 41).to(torch.float32) + 0.5) * (2.0**-23)
    return (-torch.log(-torch.log(u))).to(dtype)


def bernoulli(k: Key, p: Union[float, Tensor], shape: Sequence[int] = ()) -> Tensor:
    """Boolean samples, True with probability `p`."""
    return uniform(k, shape) < p


def randint(
    k: Key, shape: Sequence[int], minval: Union[int, Tensor], maxval: Union[int, Tensor], *,
    dtype: torch.dtype = torch.int64,
) -> Tensor:
    """Integers in `[minval, maxval)` (JAX's argument names; slightly biased for ranges near 2**62).

    `minval` / `maxval` are ints or integer tensors that broadcast against `shape`. The result is
    int64 by default (torch's index dtype; JAX's default is int32).
    """
    if not isinstance(minval, Tensor) and not isinstance(maxval, Tensor) and maxval <= minval:
        raise ValueError(f"randint needs minval < maxval, got minval={minval}, maxval={maxval}.")
    return (_srl(bits(k, shape), 1) % (maxval - minval) + minval).to(dtype)


def permutation(k: Key, n: int) -> Tensor:
    """A random permutation of `range(n)` (argsort of random bits)."""
    return torch.argsort(_srl(bits(k, (n,)), 1))


def _broadcast(a: tuple, b: tuple) -> Optional[tuple]:
    """The broadcast of two shapes, or None if they do not broadcast."""
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def categorical(
    k: Key, logits: Tensor, axis: int = -1, shape: Optional[Sequence[int]] = None, replace: bool = True,
) -> Tensor:
    """Sample category indices from unnormalised log-probabilities (`jax.random.categorical`).

    The Gumbel-max trick, `argmax(logits + gumbel)` along `axis`, drawn on `logits`' device (the
    key is moved there), so it traces whole and never syncs with the host. `-inf` logits are never
    drawn. Noise is float32 (float64 for float64 logits), whatever the logits' dtype.

    Args:
        k: the key.
        logits: `(..., n_categories, ...)` unnormalised log-probabilities along `axis`.
        axis: the categories axis of `logits`.
        shape: the result shape; default `logits.shape` without `axis`. A longer shape draws
            independent samples for its leading dims (it must end with that batch shape).
        replace: draw with replacement (default). False draws `prod(leading dims of shape)`
            distinct categories per batch element (Gumbel top-k).

    Returns:
        int64 indices of `shape` (JAX returns int32).

    Raises:
        ValueError: `shape` does not end with `logits`' batch shape, or `replace=False` asks for
            more samples than there are categories.

    Example:
        >>> import torch
        >>> from ember.core import random
        >>> logits = torch.tensor([[0.0, float("-inf")], [float("-inf"), 0.0]])
        >>> random.categorical(random.key(0), logits).tolist()
        [0, 1]
    """
    _check_key(k, "categorical")
    axis = axis % logits.dim()
    batch = tuple(logits.shape[:axis]) + tuple(logits.shape[axis + 1:])
    shape = batch if shape is None else tuple(int(d) for d in shape)
    if len(shape) < len(batch) or _broadcast(shape, batch) != shape:
        raise ValueError(
            f"categorical(shape={shape}) must end with a shape the logits' batch shape {batch} broadcasts "
            f"to (logits {tuple(logits.shape)} without axis {axis}); pass shape=(n_samples, *{batch}) or None."
        )
    prefix = shape[: len(shape) - len(batch)]
    noise_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    k = k.to(logits.device)
    if replace:
        drawn = list(shape[len(prefix):])
        drawn.insert(axis, logits.shape[axis])  # (*prefix, *batch with the categories axis back)
        noise = gumbel(k, (*prefix, *drawn), dtype=noise_dtype)
        return torch.argmax(noise + logits.to(noise_dtype), dim=len(prefix) + axis)
    if shape[len(prefix):] != batch:
        raise ValueError(f"categorical(replace=False, shape={shape}) must end with the logits' batch shape {batch}.")
    n = math.prod(prefix)
    if n > logits.shape[axis]:
        raise ValueError(f"categorical(replace=False) draws {n} distinct samples (shape {shape}), more than the "
                         f"{logits.shape[axis]} categories along axis {axis}; draw fewer or pass replace=True.")
    perturbed = (gumbel(k, tuple(logits.shape), dtype=noise_dtype) + logits.to(noise_dtype)).movedim(axis, -1)
    indices = torch.topk(perturbed, n, dim=-1).indices  # (*batch, n)
    return indices.movedim(-1, 0).reshape(shape)


def dropout(k: Key, x: Tensor, rate: float, *, deterministic: bool = False) -> Tensor:
    """Zero each element of `x` with probability `rate`, scaling the rest by `1 / (1 - rate)`.

    `rate` is a Python float (a model hyperparameter); `deterministic=True` or `rate == 0`
    returns `x` unchanged, so evaluation needs no key.
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}.")
    if deterministic or rate == 0.0:
        return x
    keep = uniform(k, x.shape) >= rate
    return torch.where(keep, x / (1.0 - rate), torch.zeros((), dtype=x.dtype, device=x.device))
