"""Rotary position embeddings (RoPE, Su et al. 2021), with optional Llama-3.1 frequency scaling.

Public names: `RotaryEmbedding`, `RopeScaling`, `YarnScaling`, `rope_frequencies`, `apply_rotary`.

Layout: queries and keys are `(B, T, H, D)` (batch, time, heads, head_dim), i.e. before the
transpose to `(B, H, T, D)` that `scaled_dot_product_attention` wants. Positions are `(T,)` or
`(B, T)` integers (default `arange(T)`), read from the `positions` keyword that the model passes to
every layer.

Pairing convention: "rotate half" (dimension i is rotated with dimension i + D/2), the convention
of Hugging Face `transformers` Llama checkpoints (their conversion script permutes Meta's
interleaved q/k weights into it), so HF weights load without any permutation.

Example:
    >>> import torch
    >>> from ember.models.layers import RotaryEmbedding
    >>> rope = RotaryEmbedding(head_dim=8, theta=10000.0)
    >>> rope.apply({}, torch.randn(2, 5, 3, 8)).shape
    torch.Size([2, 5, 3, 8])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from ...core.types import Key, Params
from .module import Module

__all__ = ["RopeScaling", "RotaryEmbedding", "YarnScaling", "apply_rotary", "rope_frequencies"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 RoPE frequency scaling ("llama3" rope_type in HF; Meta's `apply_scaling`).

    Frequencies whose wavelength is shorter than `original_max_seq_len / high_freq_factor` are kept,
    those longer than `original_max_seq_len / low_freq_factor` are divided by `factor`, and the band
    in between is interpolated smoothly. Defaults are Llama-3.1's published values
    (factor 8, low 1, high 4, original context 8192); Llama-3.2 1B/3B use factor 32.

    Attributes:
        factor: how much longer the extended context is than the original.
        low_freq_factor: wavelengths above `original_max_seq_len / low_freq_factor` are scaled fully.
        high_freq_factor: wavelengths below `original_max_seq_len / high_freq_factor` are untouched.
        original_max_seq_len: the context length the base model was trained with.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor}.")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"RopeScaling needs high_freq_factor > low_freq_factor > 0, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}."
            )
        if self.original_max_seq_len <= 0:
            raise ValueError(
                f"RopeScaling.original_max_seq_len must be positive, got {self.original_max_seq_len}."
            )


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): HF rope_type "yarn".

    Fast-rotating dimensions (more than `beta_fast` turns over the original context) keep their
    frequency, slow ones (under `beta_slow` turns) are divided by `factor`, with a linear ramp
    between; cos and sin are multiplied by `attention_factor`. DeepSeek-V3 uses factor 40 over 4,096
    positions with `mscale = mscale_all_dim = 1` (so `attention_factor` 1), and its attention
    multiplies the softmax scale by `softmax_scale_factor` (`mscale_all_dim`'s share).

    Attributes:
        factor: how much longer the extended context is than the original.
        original_max_seq_len: the context length the base model was trained with.
        beta_fast, beta_slow: the ramp's ends, in rotations over the original context.
        mscale, mscale_all_dim: DeepSeek's magnitude corrections (0: unused).
        truncate: round the ramp's ends to whole dimensions (transformers' default).
    """

    factor: float = 40.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor >= 1.0 or self.original_max_seq_len <= 0 or not self.beta_fast >= self.beta_slow > 0:
            raise ValueError(f"YarnScaling needs factor >= 1, original_max_seq_len > 0 and beta_fast >= beta_slow > 0, "
                             f"got {self}.")

    @staticmethod
    def _magnitude(factor: float, mscale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by."""
        if self.mscale and self.mscale_all_dim:
            return self._magnitude(self.factor, self.mscale) / self._magnitude(self.factor, self.mscale_all_dim)
        return self._magnitude(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """What DeepSeek's attention multiplies its softmax scale by (1 without `mscale_all_dim`)."""
        return self._magnitude(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def frequencies(self, wavelengths: Tensor, head_dim: int, theta: float) -> Tensor:
        """The inverse frequencies `(D/2,)`: `1 / wavelengths` blended with `1 / (factor * wavelengths)` along the ramp."""
        def turns_dim(turns: float) -> float:  # the dimension that turns `turns` times over the original context
            return head_dim * math.log(self.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = turns_dim(self.beta_fast), turns_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high
        ramp = (torch.arange(head_dim // 2, dtype=torch.float32, device=wavelengths.device) - low) / (high - low)
        keep = 1 - ramp.clamp(0, 1)  # 1: the dimension keeps its frequency
        return 1.0 / (self.factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep


def rope_frequencies(
    head_dim: int,
    *,
    theta: float,
    scaling: Optional[Union[RopeScaling, YarnScaling]] = None,
    device: Optional[torch.device] = None,
) -> Tensor:
    """Inverse frequencies `theta ** (-2i / head_dim)`, i < head_dim/2, float32 `(head_dim // 2,)`.

    Computed in float32 the way Hugging Face's `LlamaRotaryEmbedding` does, so angles agree bitwise.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    if isinstance(scaling, YarnScaling):
        return scaling.frequencies(theta**exponents, head_dim, theta)
    inv_freq = 1.0 / (theta**exponents)  # (D/2,)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (..., D/2) each
    return torch.cat((-x2, x1), dim=-1)  # (..., D)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` (B, T, H, D) by angles with `cos`/`sin` of shape (T, D) or (B, T, D).

    Computes in float32 and returns `x`'s dtype.
    """
    cos = cos.unsqueeze(-2)  # (T, 1, D) or (B, T, 1, D): broadcast over heads
    sin = sin.unsqueeze(-2)
    x32 = x.float()
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding(Module):
    """Applies RoPE to `(B, T, H, D)` queries or keys; has no parameters.

    Attributes:
        head_dim: D, the rotated dimension (must be even).
        theta: base wavelength; 10,000 in RoFormer (Su et al. 2021, eq. 15), 500,000 in Llama 3
            ("The Llama 3 Herd of Models", §3.1.1: raised to support long contexts).
        scaling: optional Llama-3.1 or YaRN frequency scaling.
    """

    head_dim: int
    theta: float = 10000.0
    scaling: Optional[Union[RopeScaling, YarnScaling]] = None

    reads_key = False

    def validate(self) -> None:
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"RotaryEmbedding.head_dim must be a positive even int, got {self.head_dim!r}.")
        if not self.theta > 0:
            raise ValueError(f"RotaryEmbedding.theta must be > 0, got {self.theta!r}.")

    def cos_sin(self, positions: Tensor) -> Tuple[Tensor, Tensor]:
        """Angles for integer `positions` (T,) or (B, T): float32 `(cos, sin)` of shape (..., T, D)."""
        inv_freq = rope_frequencies(self.head_dim, theta=self.theta, scaling=self.scaling, device=positions.device)
        angles = positions.float().unsqueeze(-1) * inv_freq  # (..., T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., T, D): rotate-half pairing
        if isinstance(self.scaling, YarnScaling) and self.scaling.attention_factor != 1.0:
            return angles.cos() * self.scaling.attention_factor, angles.sin() * self.scaling.attention_factor
        return angles.cos(), angles.sin()

    def apply(self, params: Params, x: Tensor, *, key: Optional[Key] = None, **kwargs: Any) -> Tensor:
        """Args: x: (B, T, H, D); kwargs `positions`: (T,) or (B, T) ints, default arange(T). Returns: (B, T, H, D)."""
        positions = kwargs.get("positions")
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin)
