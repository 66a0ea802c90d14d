"""`train_step`: build a pure `step(state, batch) -> (state, metrics)` from a loss function.

Public names: `train_step`.

The step is a pure function of its inputs: randomness comes from `fold_in(state.key, state.step)`,
nothing is modified in place, and there is no host sync or Python branching on tensor values, so
the same step runs eagerly, under `torch.compile(fullgraph=True)` and under torch_xla.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..partition_specs.sharding import batch_axes, constrain
from ..pytree import keystr, tree_flatten_with_path, tree_map, tree_unflatten
from ..random import fold_in
from ..scan import rolled_sum
from ..transforms import value_and_grad
from ..tree_math import apply_updates, global_norm, tree_cast, tree_scale, tree_where
from ..types import Batch, Key, Metrics, Params
from ..protocols import GradientTransformation, check_gradient_transformation
from .statistic_leaves import NO_STATISTICS, statistic_leaves_of
from ._common import (RESERVED_METRICS, check_builder_args, check_state, frozen_kwargs, learning_rates,
                      split_loss_output)
from .token_loss import TokenLoss
__all__ = ["train_step"]

LossFn = Callable[..., Any]
"""`loss_fn(params, batch, *, key) -> loss` or `-> (loss, aux)`; loss 0-d, aux a dict of 0-d."""

_MSG_NO_TX = (
    "train_step has no gradient transformation: pass `train_step(loss_fn, tx)` or build the "
    "state with `TrainState.create(params=..., tx=tx)` so that `state.tx` is set."
)


def _like_param(g: Tensor, p: Tensor) -> Tensor:
    """`g` in `p`'s dtype, contiguous when `p` is."""
    g = g.to(p.dtype)
    return g.contiguous() if p.is_contiguous() and not g.is_contiguous() else g


def _check_args(loss_fn: Any, tx: Any, microbatches: Any, compute_dtype: Any, accumulate_dtype: Any) -> None:
    check_builder_args("train_step", loss_fn, compute_dtype)
    if not (isinstance(accumulate_dtype, torch.dtype) and accumulate_dtype.is_floating_point):
        raise TypeError(
            f"train_step(accumulate_dtype=...) must be a floating torch.dtype such as torch.float32, "
            f"got {accumulate_dtype!r}."
        )
    if tx is not None:
        check_gradient_transformation(tx, where="train_step(tx=...)")
    if tx is not None and not isinstance(tx, GradientTransformation):  # optax's are named above
        raise TypeError(
            f"train_step(tx=...) expects a gradient transformation with "
            f"`update(grads, opt_state, params)`, got {type(tx).__name__}. "
            f"Build one with ember.optim, e.g. `ember.optim.adamw(3e-4)`."
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int):
        raise TypeError(f"train_step(microbatches=...) must be an int >= 1, got {microbatches!r}.")
    if microbatches < 1:
        raise ValueError(
            f"train_step(microbatches=...) must be >= 1 (1 means no gradient accumulation), "
            f"got {microbatches}."
        )


def split_microbatches(batch: Batch, microbatches: int) -> List[Batch]:
    """Split every tensor leaf of `batch` along dim 0 into `microbatches` equal chunks.

    Args:
        batch: pytree whose tensor leaves share a leading batch dim `B`; non-tensor leaves are
            passed to every chunk unchanged.
        microbatches: number of chunks; `B` must be divisible by it.

    Returns:
        A list of `microbatches` batches with the structure of `batch`, leaves `(B // m, ...)`
        (views, no copies).

    Raises:
        ValueError: a tensor leaf is 0-d or its leading dim is not divisible by `microbatches`.
    """
    if microbatches == 1:
        return [batch]
    leaves, spec = tree_flatten_with_path(batch)
    sizes = []
    for path, leaf in leaves:
        if not isinstance(leaf, Tensor):
            sizes.append(None)
            continue
        name = "batch" + (f".{keystr(path)}" if path else "")
        if leaf.dim() == 0:
            raise ValueError(
                f"cannot split {name} into {microbatches} microbatches: it is 0-d. Every batch "
                f"tensor needs a leading batch dim, or use microbatches=1."
            )
        n = leaf.shape[0]
        if n % microbatches != 0:
            fits = [m for m in range(1, n + 1) if n % m == 0]
            raise ValueError(
                f"cannot split {name} (leading dim {n}, shape {tuple(leaf.shape)}) into "
                f"{microbatches} equal microbatches: {n} % {microbatches} = {n % microbatches}. "
                f"Use a batch size divisible by {microbatches}, or microbatches in {fits}."
            )
        sizes.append(n // microbatches)
    chunks = []
    for i in range(microbatches):
        out = [
            leaf.narrow(0, i * size, size) if size is not None else leaf
            for (_, leaf), size in zip(leaves, sizes)
        ]
        chunks.append(tree_unflatten(out, spec))
    return chunks


def train_step(
    loss_fn: LossFn,
    tx: Any = None,
    *,
    microbatches: int = 1,
    skip_nonfinite: bool = True,
    compute_dtype: Optional[torch.dtype] = None,
    accumulate_dtype: torch.dtype = torch.float32,
) -> Callable[[Any, Batch], Tuple[Any, Metrics]]:
    """Build a pure training step from `loss_fn` and a gradient transformation.

    The step computes `loss_fn`'s gradient with respect to `state.params`, runs `tx.update`,
    applies the updates and advances `state.step`. Per-step randomness is
    `step_key = fold_in(state.key, state.step)`; with `microbatches > 1`, microbatch `i` gets
    `fold_in(step_key, i)`, otherwise `loss_fn` gets `step_key` itself. `state.key` never changes.

    `loss_fn(params, batch, *, key)` returns a loss or `(loss, aux)` with `aux` a dict of 0-d
    tensors (told apart by structure at trace time). A state whose `frozen` field is set (a DPO
    reference: `TrainStateWithFrozen.create(..., frozen=reference_params)`) has it passed as
    `loss_fn(params, batch, key=key, frozen=state.frozen)`; it gets no gradient and no update.
    The loss is either a `TokenLoss(total, count)` (summed per-token losses and the number of valid
    tokens; a preference loss counts pairs) or a 0-d mean. With `microbatches = m`,
    every tensor leaf of the batch is split along dim 0 into `m` equal chunks and gradients are
    accumulated in `accumulate_dtype`. A `TokenLoss` is token-weighted: totals, counts and
    gradients are summed over the chunks (and, on a mesh, over data-parallel ranks) and divided
    once by the total count, so the step is the same for any `m`. A mean loss becomes the mean of
    the chunk means (the full batch's only when every chunk has the same weight). Aux metrics are
    averaged over the chunks. Under `jit(backend="inductor")` the chunks are one `scan` node whose
    carry is the sum (`rolled_sum`); on torch_xla chunks 2..m are one `While`. Compile time does not
    grow with `m`.

    With `compute_dtype` (e.g. `torch.bfloat16`), floating params and floating batch leaves are
    cast to it for the forward and backward pass; master params stay in their own dtype and
    gradients come back in it through the cast. With `skip_nonfinite`, a step whose loss or any
    gradient is NaN/inf keeps `params` and `opt_state` (selected with `tree_where`, no host
    sync), increments `state.skipped_steps`, and still advances `state.step`. A loss function whose
    `statistic_leaves` (a `StatisticLeaves`) marks leaves that get a statistic as their gradient
    (`ember.models.lm_loss` of a model with an expert bias) has those leaves moved by its rule: the
    transformation, the clip and the metrics' norms see zeros there, whoever built `tx`.

    Metrics (a dict of 0-d tensors, never synced to host):
        `loss` (float32: the token-weighted mean, or the mean of the chunk means), `tokens` (float32
        count of valid tokens in the step, for a `TokenLoss`), `grad_norm` (global L2 norm of the
        accumulated gradients), `update_norm` (global norm of the update actually applied: 0 for a skipped
        step), `lr` (the first leaf of the new `opt_state` whose path ends in
        `hyperparams.learning_rate`, as ember.optim aliases have; absent otherwise; with parameter
        groups, `optim.partition`'s, also `lr/<label>` per group), `skipped`
        (float32 1.0 if this step was skipped, else 0.0), then the aux metrics (float32).

    Args:
        loss_fn: `loss_fn(params, batch, *, key) -> loss | (loss, aux)`.
        tx: gradient transformation (`update(grads, opt_state, params)`); defaults to `state.tx`.
        microbatches: number of equal chunks to split the batch into (gradient accumulation).
        skip_nonfinite: skip updates whose loss or gradients are not finite.
        compute_dtype: floating dtype for the forward/backward pass, or None for the params' own.
        accumulate_dtype: floating dtype the gradients are accumulated and normalised in.

    Returns:
        `step(state, batch) -> (new_state, metrics)`, pure and traceable.

    Raises:
        TypeError: `loss_fn` is not callable, `tx` has no `update`, `microbatches` is not an int,
            `compute_dtype` is not a floating dtype; when called, a state that is not
            TrainState-like or a `loss_fn` output that is not a loss / `(loss, aux)`.
        ValueError: `microbatches < 1`; when called, a batch leaf not divisible into
            microbatches, a non-scalar loss or aux metric, a `TokenLoss` whose total or count is
            not 0-d, or an aux name that shadows a metric.

    Example:
        >>> import torch
        >>> from ember.core import TrainState, random
        >>> from ember.core.step_fns import train_step
        >>> class SGD:  # any GradientTransformation; ember.optim builds real ones (`optim.sgd(0.1)`)
        ...     def init(self, params): return {}
        ...     def update(self, grads, state, params=None): return {k: -0.1 * g for k, g in grads.items()}, state
        >>> def loss_fn(params, batch, *, key):
        ...     pred = batch["x"] @ params["w"]
        ...     return ((pred - batch["y"]) ** 2).mean()
        >>> state = TrainState.create(params={"w": torch.zeros(3)}, tx=SGD(), key=random.key(0))
        >>> batch = {"x": torch.eye(3), "y": torch.ones(3)}
        >>> step = train_step(loss_fn, microbatches=3)
        >>> state, metrics = step(state, batch)
        >>> int(state.step), round(metrics["loss"].item(), 4), sorted(metrics)
        (1, 1.0, ['grad_norm', 'loss', 'skipped', 'update_norm'])
        >>> [round(v, 4) for v in state.params["w"].tolist()]
        [0.0667, 0.0667, 0.0667]
    """
    _check_args(loss_fn, tx, microbatches, compute_dtype, accumulate_dtype)
    skip_nonfinite = bool(skip_nonfinite)
    statistics = statistic_leaves_of(loss_fn) or NO_STATISTICS

    def loss_and_grads(params: Params, batch: Batch, key: Optional[Key], read_only: Dict[str, Any]):
        """Gradients and value of one (micro)batch's summed total (`TokenLoss`) or mean loss, its count, aux."""

        def objective(p: Params):
            out = loss_fn(statistics.cast(p, compute_dtype), batch, key=key, **read_only)
            loss, aux = split_loss_output(out, reserved=RESERVED_METRICS)
            if isinstance(loss, TokenLoss):
                # Differentiate this microbatch's mean, so gradients in a low-precision compute dtype
                # keep a mean loss's scale; with microbatches, `accumulate` restores the sum in
                # `accumulate_dtype`.
                count = loss.count.detach().to(torch.float32)
                return loss.total.to(torch.float32) / count.clamp(min=1.0), (aux, {"count": count})
            return loss.to(torch.float32), (aux, {})

        (value, (aux, count)), grads = value_and_grad(objective, has_aux=True)(params)
        return tree_cast(grads, accumulate_dtype), value, count.get("count"), _aux_f32(aux)

    def microbatch(params: Params, read_only: Dict[str, Any], chunk: Batch, key: Optional[Key]):
        """One microbatch's summed gradients, value and count (a `TokenLoss`), or its mean's."""
        grads, value, count, aux = loss_and_grads(params, chunk, key, read_only)
        if count is not None:  # token-weighted: back from this microbatch's mean to its sum
            weight = count.clamp(min=1.0)
            grads, value = tree_map(lambda g: g * weight.to(g.dtype), grads), value * weight
        return grads, value, count, aux

    def accumulate(params: Params, read_only: Dict[str, Any], batch: Batch, step_key: Optional[Key]):
        batch = tree_cast(batch, compute_dtype) if compute_dtype is not None else batch
        if microbatches == 1:  # the batch's own mean (token-weighted for a TokenLoss) is the answer
            return loss_and_grads(params, batch, step_key, read_only)
        # One loop (`rolled_sum`): under jit(backend="inductor") one `scan` node; on DTensor a Python
        # loop (traced per microbatch); on XLA microbatches 2..k are one While.
        keys = None
        if step_key is not None:
            keys = torch.stack([fold_in(step_key, i) for i in range(microbatches)])
        grads, value, count, aux = rolled_sum(lambda c, x: microbatch(*c, *x), (params, read_only),
                                              (_stack_microbatches(batch, microbatches), keys))
        return _normalise(grads, value, count, aux, microbatches)

    def step(state: Any, batch: Batch) -> Tuple[Any, Metrics]:
        check_state(state, "train_step's step(state, batch)")
        transform = tx if tx is not None else getattr(state, "tx", None)
        if transform is None or not callable(getattr(transform, "update", None)):
            raise TypeError(_MSG_NO_TX)
        params, opt_state = state.params, state.opt_state
        state_key = getattr(state, "key", None)
        step_key = fold_in(state_key, state.step) if state_key is not None else None

        # A reference is cast to the compute dtype once, not once per microbatch.
        acc_grads, loss, tokens, aux = accumulate(params, frozen_kwargs(state, compute_dtype), batch, step_key)
        # Leaves whose "gradient" is a statistic (an expert's load) move by their own rule; the
        # transformation and the norms see zeros there.
        split = statistics.split(params, acc_grads)
        acc_grads = split.grads
        # The optimizer sees gradients in each parameter's own dtype, whatever `microbatches`, and
        # laid out like it: a transposed gradient (an einsum's) would give the optimizer state new
        # strides, and a compiled step a second graph on its next call.
        grads = tree_map(_like_param, acc_grads, params)
        grad_norm = global_norm(acc_grads)
        # Any non-finite gradient element makes the norm non-finite, and the norm is computed
        # anyway: a second per-leaf reduction would cost one more kernel per parameter. A norm
        # that overflows float32 (above ~1.8e19) also reads as non-finite; such gradients are
        # unusable anyway.
        ok = torch.isfinite(loss) & torch.isfinite(grad_norm) if skip_nonfinite else None
        updates, new_opt_state = transform.update(grads, opt_state, params)
        new_params, update_norm = apply_updates(params, updates), global_norm(updates)
        if ok is not None:  # a skipped step keeps the old params and state
            new_params = tree_where(ok, new_params, params)
            new_opt_state = tree_where(ok, new_opt_state, opt_state)
        new_params = split.moved(new_params, ok)

        zero_i64 = torch.zeros((), dtype=torch.int64, device=state.step.device)
        if ok is not None:
            skipped = (~ok).to(torch.float32)
            update_norm = torch.where(ok, update_norm, torch.zeros_like(update_norm))
            skipped_inc = (~ok).to(torch.int64)
        else:
            skipped = torch.zeros((), dtype=torch.float32, device=loss.device)
            skipped_inc = zero_i64

        changes: Dict[str, Any] = dict(
            step=state.step + 1, params=new_params, opt_state=new_opt_state
        )
        if hasattr(state, "skipped_steps"):
            changes["skipped_steps"] = state.skipped_steps + skipped_inc
        new_state = state.replace(**changes)

        metrics: Metrics = {"loss": loss}
        if tokens is not None:
            metrics["tokens"] = tokens
        metrics.update(grad_norm=grad_norm, update_norm=update_norm)
        metrics.update(learning_rates(new_opt_state))
        metrics["skipped"] = skipped
        metrics.update(aux)
        return new_state, metrics

    return step


def _normalise(grads: Any, value: Tensor, count: Optional[Tensor], aux: Dict[str, Tensor],
               microbatches: int) -> Tuple[Any, ...]:
    """The step's gradients and loss from the microbatches' sums."""
    aux = {k: v / microbatches for k, v in aux.items()}
    if count is not None:
        # The summed totals are divided once by every valid token of the step (none gives 0, not NaN).
        denom = count.clamp(min=1.0)
        return tree_map(lambda g: g / denom.to(g.dtype), grads), value / denom, count, aux
    scale = 1.0 / microbatches  # mean losses: the mean of the microbatches' means
    return tree_scale(grads, scale), value * scale, None, aux


def _stack_microbatches(batch: Batch, microbatches: int) -> Batch:
    """`batch` with each tensor leaf's dim 0 split into `(microbatches, B // microbatches)`, each
    microbatch laid out as `shard_batch` lays out a batch. Microbatch `i` is rows `i * B // m` onward
    on every mesh; a reshape alone would shard the microbatch dim, and each slice would then be
    gathered whole onto every device."""
    split_microbatches(batch, microbatches)  # a batch that does not split raises its clear error here

    def stack(t: Tensor) -> Tensor:
        stacked = t.reshape(microbatches, t.shape[0] // microbatches, *t.shape[1:])
        return constrain(stacked, (None, *batch_axes(t.dim())))

    return tree_map(lambda t: stack(t) if isinstance(t, Tensor) else t, batch)


def _aux_f32(aux: Dict[str, Tensor]) -> Dict[str, Tensor]:
    return {k: v.detach().to(torch.float32) for k, v in aux.items()}
