"""Adafactor: its building blocks (factored second-moment rescaling, parameter-scale scaling) and the alias.

Public names: `adafactor`, `scale_by_factored_rms`, `ScaleByFactoredRmsState`, `scale_by_param_block_rms`.

For a leaf with two dimensions of at least `min_dim_size_to_factor` elements, the second moment is
kept as a row vector and a column vector (over the two largest dimensions) instead of a full
tensor, so the state costs `O(n + m)` instead of `O(n * m)`. Smaller leaves keep a full second
moment. The formulas are optax's (`optax/_src/factorized.py`); the alias `adafactor` at the end
of this file has the equations, the reference and an example.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import pytree
from ..core.pytree import tree_flatten, tree_leaves, tree_unflatten
from ..core.types import Params, Updates
from . import _foreach
from .base import NO_PARAMS_MSG, GradientTransformation, MaskedNode, Scalar, ScalarOrSchedule, stateless
from .clipping import clip_by_block_rms
from .combining import chain
from .hyperparams import inject_hyperparams
from .masking import Mask
from .momentum import ema
from .scaling import scale, scale_by_learning_rate
from .weight_decay import add_decayed_weights

__all__ = ["ScaleByFactoredRmsState", "adafactor", "scale_by_factored_rms", "scale_by_param_block_rms"]


def _factored_dims(
    shape: Sequence[int], factored: bool, min_dim_size_to_factor: int
) -> Optional[Tuple[int, int]]:
    """The two largest dims `(d1, d0)` (second largest, largest) to factor over, or None.

    Equal dims keep their axis order (a stable sort, which traces under
    `torch.compile`). optax uses `np.argsort(shape)`, which agrees for every leaf of up to 3 dims
    but is not stable for 4 or more on recent numpy (its choice then depends on the CPU's SIMD
    sort); only the rare 4-d+ leaf with tied large dims can pick a different (equally valid) axis.
    """
    if not factored or len(shape) < 2:
        return None
    sorted_dims = sorted(range(len(shape)), key=lambda i: shape[i])
    if shape[sorted_dims[-2]] < min_dim_size_to_factor:
        return None
    return int(sorted_dims[-2]), int(sorted_dims[-1])


def _without(shape: Sequence[int], axis: int) -> List[int]:
    return [s for i, s in enumerate(shape) if i != axis]


@pytree.dataclass
class ScaleByFactoredRmsState:
    """State of `scale_by_factored_rms`; each tree has the paths of params.

    Attributes:
        count: 0-d int64 tensor, the number of updates so far.
        v_row: for factored leaves, the second moment averaged over the largest dim (`d0`);
            `MaskedNode` for the others.
        v_col: for factored leaves, the second moment averaged over the second-largest dim
            (`d1`); `MaskedNode` for the others.
        v: for unfactored leaves, the full second moment; `MaskedNode` for factored ones.
    """

    count: Tensor
    v_row: Updates
    v_col: Updates
    v: Updates


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: Scalar = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: Scalar = 1e-30,
) -> GradientTransformation:
    """Rescale updates by a (factored) estimate of the gradients' root mean square.

    With `beta_t = 1 - (t + 1) ** -decay_rate` (`t` = count - step_offset) and `G = g**2 + eps`:
    unfactored leaves keep `v = beta_t * v + (1 - beta_t) * G` and update `g / sqrt(v)`;
    factored leaves keep row/column means of `G` the same way and update
    `g / sqrt(outer(v_row / mean(v_row), v_col))`.

    Args:
        factored: factor the second moment of leaves with two large enough dims.
        decay_rate: exponent of the second-moment decay schedule (number or 0-d tensor).
        step_offset: subtracted from the count (for fine-tuning from a later step).
        min_dim_size_to_factor: factor only if the second-largest dim has at least this size.
        epsilon: added to the squared gradient (number or 0-d tensor).

    Returns:
        A `GradientTransformation` with a `ScaleByFactoredRmsState`; see `ember.optim.adafactor`.
    """

    def dims(shape: Sequence[int]) -> Optional[Tuple[int, int]]:
        return _factored_dims(shape, factored, min_dim_size_to_factor)

    def init_fn(params: Params) -> ScaleByFactoredRmsState:
        leaves, spec = tree_flatten(params)
        rows, cols, full = [], [], []
        for p in leaves:
            d = dims(p.shape)
            if d is None:
                rows.append(MaskedNode())
                cols.append(MaskedNode())
                full.append(torch.zeros_like(p))
            else:
                d1, d0 = d
                rows.append(p.new_zeros(_without(p.shape, d0)))
                cols.append(p.new_zeros(_without(p.shape, d1)))
                full.append(MaskedNode())
        return ScaleByFactoredRmsState(
            count=_foreach.zero_count(params),
            v_row=tree_unflatten(rows, spec),
            v_col=tree_unflatten(cols, spec),
            v=tree_unflatten(full, spec),
        )

    def update_fn(
        updates: Updates, state: ScaleByFactoredRmsState, params: Optional[Params] = None
    ) -> Tuple[Updates, ScaleByFactoredRmsState]:
        del params
        grads, spec = tree_flatten(updates)
        count = state.count + 1
        if not grads:
            return updates, state.replace(count=count)
        rows, cols, full = (spec.flatten_up_to(t) for t in (state.v_row, state.v_col, state.v))
        t = (state.count - step_offset + 1).to(torch.float32)
        beta = 1.0 - torch.pow(t, -decay_rate)
        grad_sqr = _foreach.add_scalar(torch._foreach_mul(grads, grads), epsilon)
        fac = [i for i, g in enumerate(grads) if dims(g.shape) is not None]
        unf = [i for i, g in enumerate(grads) if dims(g.shape) is None]
        out: List[Tensor] = [None] * len(grads)  # type: ignore[list-item]
        new_rows, new_cols, new_full = list(rows), list(cols), list(full)
        if unf:
            old = [full[i] for i in unf]
            v = _foreach.moment([grad_sqr[i] for i in unf], old, beta)
            v = _foreach.cast(v, _foreach.dtypes_of(old))
            upd = torch._foreach_div([grads[i] for i in unf], torch._foreach_sqrt(v))
            for j, i in enumerate(unf):
                out[i], new_full[i] = upd[j], v[j]
        if fac:
            d = [dims(grads[i].shape) for i in fac]
            old_r, old_c = [rows[i] for i in fac], [cols[i] for i in fac]
            row_mean = [grad_sqr[i].mean(dim=d0) for i, (d1, d0) in zip(fac, d)]
            col_mean = [grad_sqr[i].mean(dim=d1) for i, (d1, d0) in zip(fac, d)]
            vr = _foreach.cast(_foreach.moment(row_mean, old_r, beta), _foreach.dtypes_of(old_r))
            vc = _foreach.cast(_foreach.moment(col_mean, old_c, beta), _foreach.dtypes_of(old_c))
            # v_row lost axis d0, so d1 shifts down by one in it when d1 > d0.
            rc_mean = [
                r.mean(dim=d1 - 1 if d1 > d0 else d1, keepdim=True) for r, (d1, d0) in zip(vr, d)
            ]
            # g * (v_row / mean(v_row)) ** -0.5 * v_col ** -0.5, as divisions by square roots
            # (DTensor has sharding rules for `_foreach_sqrt` / `_foreach_div`, not `_foreach_pow`)
            row_rms = torch._foreach_sqrt(torch._foreach_div(vr, rc_mean))
            col_rms = torch._foreach_sqrt(vc)
            for j, i in enumerate(fac):
                d1, d0 = d[j]
                out[i] = grads[i] / row_rms[j].unsqueeze(d0) / col_rms[j].unsqueeze(d1)
                new_rows[i], new_cols[i] = vr[j], vc[j]
        new_state = ScaleByFactoredRmsState(
            count=count,
            v_row=tree_unflatten(new_rows, spec),
            v_col=tree_unflatten(new_cols, spec),
            v=tree_unflatten(new_full, spec),
        )
        return tree_unflatten(out, spec), new_state

    return GradientTransformation(init_fn, update_fn)


def scale_by_param_block_rms(min_scale: Scalar = 1e-3) -> GradientTransformation:
    """Multiply each update leaf by `max(rms(param), min_scale)` (Adafactor's relative step size).

    Args:
        min_scale: the smallest scale, so zero-initialised parameters still move.

    Returns:
        A stateless `GradientTransformation`; see `ember.optim.adafactor`.

    Raises:
        ValueError: (from `update`) `params` is None.
    """

    def scale_by_rms(updates: Updates, params: Optional[Params]) -> Updates:
        if params is None:
            raise ValueError(NO_PARAMS_MSG.format(name="scale_by_param_block_rms"))
        leaves, spec = tree_flatten(updates)
        if not leaves:
            return updates
        rms = _foreach.per_leaf_rms(tree_leaves(params))
        factor = _foreach.scalar_map(lambda r: torch.clamp_min(r, min_scale), rms)
        return tree_unflatten(list(torch._foreach_mul(leaves, factor)), spec)

    return stateless(scale_by_rms)


def _adafactor_chain(
    learning_rate: Optional[Scalar],
    min_dim_size_to_factor: int,
    decay_rate: Scalar,
    decay_offset: int,
    multiply_by_parameter_scale: bool,
    clipping_threshold: Optional[Scalar],
    momentum: Optional[Scalar],
    dtype_momentum: torch.dtype,
    weight_decay_rate: Optional[Scalar],
    eps: Scalar,
    factored: bool,
    weight_decay_mask: Optional[Mask],
) -> GradientTransformation:
    txs = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        txs.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        txs.append(scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        txs.append(scale_by_param_block_rms())
    if momentum is not None:
        txs.append(ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        txs.append(add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    txs.append(scale(-1.0))
    return chain(*txs)


def adafactor(
    learning_rate: Optional[ScalarOrSchedule] = None,
    *,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: Optional[float] = 1.0,
    momentum: Optional[float] = None,
    dtype_momentum: torch.dtype = torch.float32,
    weight_decay_rate: Optional[float] = None,
    eps: float = 1e-30,
    factored: bool = True,
    weight_decay_mask: Optional[Mask] = None,
) -> GradientTransformation:
    r"""Adafactor (Shazeer & Stern, 2018), matching `optax.adafactor`.

    Second moments of leaves with two dims of at least `min_dim_size_to_factor` are kept
    factored (a row and a column vector), which saves memory on large matrices. With
    `beta_t = 1 - t ** -decay_rate` and `G = g ** 2 + eps`:

        R_t = beta_t * R_{t-1} + (1 - beta_t) * mean_cols(G)     (rows, factored leaves)
        C_t = beta_t * C_{t-1} + (1 - beta_t) * mean_rows(G)     (columns)
        V_t = beta_t * V_{t-1} + (1 - beta_t) * G                (other leaves)
        u = g / sqrt(R_t C_t / mean(R_t))  or  g / sqrt(V_t)
        u = u / max(1, rms(u) / clipping_threshold)
        u = lr_t * u * max(rms(param), 1e-3)                     (multiply_by_parameter_scale)
        update = -(ema_momentum(u) + weight_decay_rate * param)

    Built as `chain(scale_by_factored_rms, clip_by_block_rms, scale_by_learning_rate(...,
    flip_sign=False), scale_by_param_block_rms, ema, add_decayed_weights, scale(-1))`, leaving
    out the blocks whose argument is None / False.

    Args:
        learning_rate: a number, 0-d tensor or schedule; None uses no learning rate (the step
            size is then relative to the parameter scale only).
        min_dim_size_to_factor: factor only leaves whose second-largest dim has this size.
        decay_rate: exponent of the second-moment decay schedule.
        decay_offset: subtracted from the step count (for fine-tuning).
        multiply_by_parameter_scale: scale updates by each parameter's RMS.
        clipping_threshold: per-leaf RMS clipping threshold (>= 1), or None.
        momentum: momentum (an EMA of updates), or None for none.
        dtype_momentum: dtype of the momentum buffer.
        weight_decay_rate: decoupled weight decay, or None.
        eps: added to the squared gradients.
        factored: use factored second moments at all.
        weight_decay_mask: which parameters to decay (as `adamw`'s `mask`).

    Returns:
        A `GradientTransformation` with an `InjectHyperparamsState`.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> params = {"w": torch.ones(256, 128)}
        >>> tx = optim.adafactor(1e-2)
        >>> state = tx.init(params)
        >>> factored = state.inner_state[0]  # chain's first state: scale_by_factored_rms
        >>> tuple(factored.v_row["w"].shape), tuple(factored.v_col["w"].shape)
        ((128,), (256,))

    References:
        Shazeer & Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory Cost, 2018
        (https://arxiv.org/abs/1804.04235).
    """
    return inject_hyperparams(
        _adafactor_chain,
        static_args=("min_dim_size_to_factor", "decay_offset", "weight_decay_mask"),
    )(
        learning_rate=learning_rate,
        min_dim_size_to_factor=min_dim_size_to_factor,
        decay_rate=decay_rate,
        decay_offset=decay_offset,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        clipping_threshold=clipping_threshold,
        momentum=momentum,
        dtype_momentum=dtype_momentum,
        weight_decay_rate=weight_decay_rate,
        eps=eps,
        factored=factored,
        weight_decay_mask=weight_decay_mask,
    )
