"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for hidden matrices (optax.contrib's `muon`).

Public names: `muon`, `scale_by_muon`, `scale_by_shape`, `orthogonalize_via_newton_schulz`,
`MuonDimensionNumbers`, `ScaleByMuonState`, `muon_labels`.

`muon(lr)` is `partition`: leaves labelled `"muon"` get `scale_by_muon` (momentum, its bias-corrected
Nesterov look-ahead, then about five quintic Newton-Schulz steps that push every singular value towards 1),
`scale_by_shape` (the update's RMS made independent of the matrix's width), decoupled weight decay and the
learning rate; the others (`"adam"`) get AdamW. The labels and the meaning are optax's, with one difference
of layout: a matrix here is torch's `(out, in)` (`MuonDimensionNumbers(reduction_axis=-1, output_axis=-2)`,
every leading axis a batch: a stack of layers or of experts is orthogonalised matrix by matrix), where
optax's is `(in, out)`. optax labels every 2-D leaf `"muon"`; for an ember model, whose stacked norms are 2-D
too, give the model's logical axes: `muon(lr, param_axes=model.axes)` labels by them (`muon_labels`) and places
each sharded matrix's iteration by them on torch_xla (`on_whole_axes`; DTensor reads its placements).

Example:
    >>> import torch
    >>> from ember import optim
    >>> x = orthogonalize_via_newton_schulz(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)))
    >>> s = torch.linalg.svdvals(x)
    >>> bool(0.6 < s.min() and s.max() < 1.3)  # the quintic's band around 1, not exactly 1
    True
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..core import pytree
from ..core.local_shards import is_dtensor
from ..core.partition_specs.whole_axes import WholeAxesPlacement, on_whole_axes
from ..core.pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from ..core.tree_math import tree_zeros_like
from ..core.types import Params, PyTree, Updates
from . import _foreach
from .adam import scale_by_adam
from .base import EmptyState, GradientTransformation, Scalar, ScalarOrSchedule
from .combining import chain
from .hyperparams import inject_hyperparams
from .partition import partition
from .scaling import scale_by_learning_rate
from .weight_decay import add_decayed_weights

__all__ = ["MuonDimensionNumbers", "ScaleByMuonState", "muon", "muon_labels", "orthogonalize_via_newton_schulz",
           "scale_by_muon", "scale_by_shape"]

NS_COEFFS = (3.4445, -4.775, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients (optax's and torch.optim.Muon's default)."""

BATCH_AXES = ("layers", "expert")
"""Logical axes that stack matrices (`muon_labels` orthogonalises along the others)."""


class MuonDimensionNumbers(NamedTuple):
    """Which axes of a leaf are the matrix's `in` (reduced by the layer) and `out`; the rest are a batch."""

    reduction_axis: Union[int, Tuple[int, ...]] = -1
    output_axis: Union[int, Tuple[int, ...]] = -2


def _axes(ndim: int, axes: Union[int, Tuple[int, ...]]) -> Tuple[int, ...]:
    return tuple(a % ndim for a in ((axes,) if isinstance(axes, int) else axes))


def _matrix_axes(ndim: int, dims: MuonDimensionNumbers) -> Tuple[int, ...]:
    return _axes(ndim, dims.reduction_axis) + _axes(ndim, dims.output_axis)


def _as_batched_matrices(x: Tensor, dims: MuonDimensionNumbers) -> Tuple[Tensor, Callable[[Tensor], Tensor]]:
    """`x` as `(batch, fan_in, fan_out)` (optax's orientation), and the function that puts such a result back."""
    if x.dim() < 2:
        raise ValueError(
            f"muon orthogonalises matrices, but got a {x.dim()}-D leaf of shape {tuple(x.shape)}. Label it for "
            f"AdamW: muon(..., param_labels=...) with 'adam' for vectors and scalars (muon_labels does).")
    reduce, out = _axes(x.dim(), dims.reduction_axis), _axes(x.dim(), dims.output_axis)
    if set(reduce) & set(out):
        raise ValueError(f"MuonDimensionNumbers: the reduction axes {reduce} and output axes {out} of a leaf of "
                         f"shape {tuple(x.shape)} overlap; give each axis one role.")
    batch = tuple(a for a in range(x.dim()) if a not in reduce and a not in out)
    order = batch + reduce + out
    moved = x.permute(order)
    size = lambda axes: math.prod([x.shape[a] for a in axes])  # noqa: E731
    flat = moved.reshape(size(batch), size(reduce), size(out))

    def back(y: Tensor) -> Tensor:
        return y.reshape(moved.shape).permute(tuple(sorted(range(x.dim()), key=order.__getitem__)))

    return flat, back


def orthogonalize_via_newton_schulz(x: Tensor, ns_coeffs: Sequence[float] = NS_COEFFS, ns_steps: int = 5,
                                    eps: Scalar = 1e-8, dimension_numbers: Optional[MuonDimensionNumbers] = None,
                                    dtype: Optional[torch.dtype] = None) -> Tensor:
    """`x`'s matrices pushed towards their orthogonal factor by `ns_steps` quintic Newton-Schulz steps.

    Each matrix is divided by its Frobenius norm (plus `eps`), iterated in `dtype` (default `x`'s; bf16 as the
    references do on a GPU) with its shorter side first, and returned in `x`'s dtype and layout.
    """
    flat, back = _as_batched_matrices(x, dimension_numbers or MuonDimensionNumbers())
    m = flat.to(dtype) if dtype is not None else flat
    wide = m.shape[-2] > m.shape[-1]
    if wide:
        m = m.transpose(-2, -1)
    m = m / (torch.linalg.vector_norm(m, dim=(-2, -1), keepdim=True) + eps)
    a, b, c = ns_coeffs
    for _ in range(ns_steps):  # torch.optim.Muon's operations, batched: a * m + (b * gram + c * gram @ gram) @ m
        gram = m @ m.transpose(-2, -1)
        m = torch.baddbmm(m, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), m, beta=a)
    if wide:
        m = m.transpose(-2, -1)
    return back(m.to(x.dtype))


def _leaf_axes(weight_axes: PyTree, updates: Updates) -> list:
    """The logical axes of each leaf of `updates` (the params' structure, a group's other leaves `MaskedNode`s)."""
    slots, _ = tree_flatten(updates, is_leaf=lambda x: isinstance(x, pytree.MaskedNode))
    axes, _ = tree_flatten(weight_axes, is_leaf=lambda x: isinstance(x, tuple))
    if len(axes) != len(slots):
        raise ValueError(f"scale_by_muon(weight_axes=...) names {len(axes)} leaves but the params have {len(slots)}; "
                         f"pass the model's own axes (model.axes).")
    return [a for slot, a in zip(slots, axes) if not isinstance(slot, pytree.MaskedNode)]


@pytree.dataclass
class ScaleByMuonState:
    """State of `scale_by_muon`: the 0-d int64 step `count` and the momentum `mu` (params' structure)."""

    count: Tensor
    mu: Updates


def scale_by_muon(ns_coeffs: Sequence[float] = NS_COEFFS, ns_steps: int = 5, beta: Scalar = 0.95,
                  eps: Scalar = 1e-8, mu_dtype: Optional[torch.dtype] = None, *, nesterov: bool = True,
                  weight_dimension_numbers: Optional[MuonDimensionNumbers] = None,
                  ns_dtype: Optional[torch.dtype] = None,
                  ns_placement: Optional[WholeAxesPlacement] = None,
                  weight_axes: Optional[PyTree] = None) -> GradientTransformation:
    """Momentum, bias-corrected (with Nesterov's look-ahead), then orthogonalised: optax.contrib's `scale_by_muon`.

    Args:
        ns_coeffs: the quintic's three coefficients.
        ns_steps: Newton-Schulz steps.
        beta: the momentum's decay.
        eps: added to each matrix's norm before dividing by it.
        mu_dtype: dtype of the momentum (default: the param's).
        nesterov: orthogonalise `beta * mu_hat(t + 1) + (1 - beta) * g_hat(t)` instead of `mu_hat(t)`.
        weight_dimension_numbers: the `in` and `out` axes of every leaf (default: torch's `(..., out, in)`).
        ns_dtype: the dtype the iteration runs in (default: the leaf's).
        ns_placement: where a sharded matrix is orthogonalised whole (`on_whole_axes`): `"owner"`, one
            process per matrix, `"gather"`, every process every matrix, or None: owner where the mesh has an
            all-to-all, gather on a CPU mesh.
        weight_axes: the params' logical axes (`model.axes`): on torch_xla the placements become sharding
            constraints from them (without them XLA's partitioner places the iteration itself).
    """
    dims = weight_dimension_numbers or MuonDimensionNumbers()

    def init_fn(params: Params) -> ScaleByMuonState:
        return ScaleByMuonState(count=_foreach.zero_count(params), mu=tree_zeros_like(params, dtype=mu_dtype))

    def update_fn(updates: Updates, state: ScaleByMuonState,
                  params: Optional[Params] = None) -> Tuple[Updates, ScaleByMuonState]:
        del params
        grads, spec = tree_flatten(updates)
        count = state.count + 1
        if not grads:
            return updates, state.replace(count=count)
        mu_old = tree_leaves(state.mu)
        mu = _foreach.moment(grads, mu_old, beta)
        if nesterov:
            mu_hat = _foreach.look_ahead(mu, grads, beta, count)
        else:
            mu_hat = torch._foreach_div(mu, _foreach.bias_correction(beta, count))
        plain_eps = eps.to_local() if is_dtensor(eps) else eps  # a hyperparameter of a sharded state
        ns = lambda m: orthogonalize_via_newton_schulz(m, ns_coeffs, ns_steps, plain_eps, dims, ns_dtype)  # noqa: E731
        axes = _leaf_axes(weight_axes, updates) if weight_axes is not None else [None] * len(mu_hat)
        out = [on_whole_axes(ns, m, _matrix_axes(m.dim(), dims), placement=ns_placement, axes=a)
               for m, a in zip(mu_hat, axes)]
        mu = _foreach.cast(mu, _foreach.dtypes_of(mu_old))
        return tree_unflatten(out, spec), ScaleByMuonState(count=count, mu=tree_unflatten(mu, spec))

    return GradientTransformation(init_fn, update_fn)


def scale_by_shape(weight_dimension_numbers: Optional[MuonDimensionNumbers] = None,
                   consistent_rms: Optional[Scalar] = None) -> GradientTransformation:
    """Scale each matrix's update by its shape: `sqrt(max(1, fan_out / fan_in))` (Keller Jordan's, torch's
    `adjust_lr_fn="original"`), or with `consistent_rms` `sqrt(max(fan_in, fan_out)) * consistent_rms` (0.2:
    AdamW's update RMS, torch's `"match_rms_adamw"`)."""
    dims = weight_dimension_numbers or MuonDimensionNumbers()

    def factor(u: Tensor) -> float:
        fan_in = math.prod([u.shape[a] for a in _axes(u.dim(), dims.reduction_axis)])
        fan_out = math.prod([u.shape[a] for a in _axes(u.dim(), dims.output_axis)])
        return math.sqrt(max(fan_in, fan_out)) if consistent_rms is not None else math.sqrt(max(1.0, fan_out / fan_in))

    def init_fn(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update_fn(updates: Updates, state: Any, params: Optional[Params] = None) -> Tuple[Updates, Any]:
        rms = 1.0 if consistent_rms is None else consistent_rms
        return tree_map(lambda u: u * (factor(u) * rms), updates), state

    return GradientTransformation(init_fn, update_fn)


def muon_labels(axes: PyTree) -> PyTree:
    """`"muon"` for a model's hidden matrices, `"adam"` for the rest, from its logical axes (`model.axes`).

    A matrix: two axes besides the stacking ones (`layers`, `expert`), neither of them `vocab` (the embedding and
    the LM head go to AdamW, as norms, biases and scalars do). An expert stack is orthogonalised per expert.
    """
    def label(names: Tuple[Optional[str], ...]) -> str:
        rest = [n for n in names if n not in BATCH_AXES]
        return "muon" if len(rest) == 2 and "vocab" not in rest else "adam"

    return tree_map(label, axes, is_leaf=lambda x: isinstance(x, tuple))


def _default_labels(params: Params) -> PyTree:
    return tree_map(lambda p: "muon" if p.dim() == 2 else "adam", params)


def _muon_chain(learning_rate: Scalar, beta: Scalar, eps: Scalar, weight_decay: Scalar, adam_b1: Scalar,
                adam_b2: Scalar, adam_eps_root: Scalar, adam_weight_decay: Scalar, adam_learning_rate: Scalar, *,
                ns_coeffs: Sequence[float], ns_steps: int, weight_decay_mask: Any, mu_dtype: Optional[torch.dtype],
                nesterov: bool, dims: Optional[MuonDimensionNumbers], consistent_rms: Optional[float],
                ns_dtype: Optional[torch.dtype], ns_placement: Optional[WholeAxesPlacement],
                param_axes: Optional[PyTree], param_labels: Any) -> GradientTransformation:
    return partition({
        "muon": chain(scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov,
                                    weight_dimension_numbers=dims, ns_dtype=ns_dtype, ns_placement=ns_placement,
                                    weight_axes=param_axes),
                      scale_by_shape(dims, consistent_rms),
                      add_decayed_weights(weight_decay, weight_decay_mask),
                      scale_by_learning_rate(learning_rate)),
        "adam": chain(scale_by_adam(adam_b1, adam_b2, eps, adam_eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
                      add_decayed_weights(adam_weight_decay),
                      scale_by_learning_rate(adam_learning_rate)),
    }, param_labels)


def muon(learning_rate: ScalarOrSchedule, ns_coeffs: Sequence[float] = NS_COEFFS, ns_steps: int = 5,
         beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0, weight_decay_mask: Any = None,
         mu_dtype: Optional[torch.dtype] = None, *, nesterov: bool = True, adam_b1: float = 0.9,
         adam_b2: float = 0.999, adam_eps_root: float = 0.0, adam_weight_decay: float = 0.0,
         adam_learning_rate: Optional[ScalarOrSchedule] = None,
         muon_weight_dimension_numbers: Optional[MuonDimensionNumbers] = None,
         consistent_rms: Optional[float] = None, ns_dtype: Optional[torch.dtype] = None,
         ns_placement: Optional[WholeAxesPlacement] = None, param_axes: Optional[PyTree] = None,
         param_labels: Any = None) -> GradientTransformation:
    """Muon for the leaves labelled `"muon"`, AdamW for those labelled `"adam"`: optax.contrib's `muon`.

    Its hyperparameters are 0-d tensors in the state (`inject_hyperparams`): changing a rate never recompiles.
    `ns_dtype` runs the Newton-Schulz iteration in another dtype (`torch.bfloat16`, as torch.optim.Muon does),
    `ns_placement` places it on a mesh (`scale_by_muon`);
    `param_labels` (a tree of `"muon"` / `"adam"`, or a function of the params) defaults to optax's rule, every
    2-D leaf to Muon; for an ember model pass `param_axes=model.axes`, which labels by `muon_labels(model.axes)`
    and places the iteration on torch_xla too. The other arguments are optax's.
    """
    if param_labels is None:
        param_labels = _default_labels if param_axes is None else muon_labels(param_axes)
    return inject_hyperparams(_muon_chain, static_args=(
        "ns_coeffs", "ns_steps", "weight_decay_mask", "mu_dtype", "nesterov", "dims", "consistent_rms", "ns_dtype",
        "ns_placement", "param_axes", "param_labels"))(
        learning_rate=learning_rate, beta=beta, eps=eps, weight_decay=weight_decay, adam_b1=adam_b1,
        adam_b2=adam_b2, adam_eps_root=adam_eps_root, adam_weight_decay=adam_weight_decay,
        adam_learning_rate=learning_rate if adam_learning_rate is None else adam_learning_rate,
        ns_coeffs=tuple(ns_coeffs), ns_steps=ns_steps, weight_decay_mask=weight_decay_mask, mu_dtype=mu_dtype,
        nesterov=nesterov, dims=muon_weight_dimension_numbers, consistent_rms=consistent_rms, ns_dtype=ns_dtype,
        ns_placement=ns_placement, param_axes=param_axes, param_labels=param_labels)
