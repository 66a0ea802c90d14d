"""DTensor sharding rules torch lacks or gets wrong, installed by `DTensorLowering` (WORKAROUNDS entry).

Each fix is registered on DTensor's global sharding propagator, once per process (`install()` is
idempotent), only where torch's own rule is missing or is the faulty old-style one: from torch
2.10 on, rules written per mesh dimension (`op_single_dim_strategy_funcs`) take precedence, and
2.15 has fixed `select`, the norms and `logsumexp` there. What a torch upgrade would make
unnecessary:

* `aten.select.int` aliases its input's spec as its output spec when the selected dimension is
  not sharded; the dispatcher then writes the output's shape into it, which rewrites the cached
  sharding of the op that produced the input. The next identical call of that op returns a
  DTensor of the wrong shape (`keys = split(key, n); keys[i]` worked at step 1, and at step 2
  `split` returned a 0-d DTensor). pytorch/pytorch#179290, fixed upstream (#179318) the same way:
  the output spec is copied.
* `aten.gather` along a split dimension offers a "masked partial" output (each rank gathers the
  indices it owns and zeroes the others, summed later). Its mask has the index's shape, and
  ember's cross-entropy squeezes the gathered `(B, T, 1)` to `(B, T)` before the sum, which then
  fails applying a `(B, T, 1)` mask to a `(B, T)` tensor (IndexError in `_MaskPartial`). The
  option is dropped, so the gathered dimension is made whole first (the same all-gather of the
  vocabulary-split logits that `logsumexp` does). Still offered by torch 2.15's per-dimension rule.
* `aten.linalg_vector_norm` and `aten._foreach_norm` keep a `Partial(sum)` input partial and so
  return the sum of the local norms instead of the norm of the sum (pytorch/pytorch#159856, fixed
  after 2.9). A gradient that reaches the global-norm clip as a pending sum (a replicated
  parameter used on a split batch) made a dp=2 run drift from one device by 1e-3 in 10 AdamW
  steps. A partial input is now summed first; sharded inputs keep the cheap norm-partial path.
* `aten.logsumexp` has no rule (cross-entropy needs it): a non-linear reduction like `var`, whose
  reduced dimensions are made whole first (vocabulary-split logits are all-gathered).
* CPU scaled-dot-product attention (`_scaled_dot_product_flash_attention_for_cpu` and its
  backward) has no rule, while the CUDA kernels have one: q, k, v, the output and the log-sum-exp
  are all replicated, or all split on the heads dimension (tensor parallelism), or all split on
  the batch dimension (data parallelism), independently per mesh dimension. Without a mask only:
  a mask is a keyword argument, which DTensor's rule helpers do not place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__: list = []

_INSTALLED = False


def _select_with_fresh_output(original: Any) -> Any:
    def select_strategy(op_schema: Any) -> Any:
        strategy = original(op_schema)
        for op_spec in getattr(strategy, "strategies", ()):
            if op_spec.input_specs and any(op_spec.output_specs is s for s in op_spec.input_specs):
                op_spec.output_specs = dataclasses.replace(op_spec.output_specs)
        return strategy

    return select_strategy


def mask_partial_class() -> type:
    """DTensor's masked-partial placement: `_MaskPartial` in `_ops._embedding_ops` (2.9),
    `MaskPartial` (2.10) then `_MaskPartial` (2.11 on) in `placement_types`."""
    from torch.distributed.tensor import placement_types

    found = getattr(placement_types, "_MaskPartial", None) or getattr(placement_types, "MaskPartial", None)
    if found is None:
        from torch.distributed.tensor._ops._embedding_ops import _MaskPartial as found
    return found


def _gather_without_mask_partial(original: Any) -> Any:
    def gather_strategy(op_schema: Any) -> Any:
        mask_partial = mask_partial_class()
        strategy = original(op_schema)
        keep = [s for s in strategy.strategies
                if not any(isinstance(p, mask_partial) for p in s.output_spec.placements)]
        if keep:
            strategy.strategies[:] = keep
        return strategy

    return gather_strategy


def _norm_reduction(input_strategy: Any, reduce_dims: list, keep_dim: bool, norm_type: Any) -> Any:
    from torch.distributed.tensor._ops._math_ops import NormReduction, common_reduction_strategy

    partial = any(p.is_partial() for s in input_strategy.strategies for p in s.output_spec.placements)
    return common_reduction_strategy(input_strategy, reduce_dims, keep_dim=keep_dim, reduction_linear=not partial,
                                     reduction_op=NormReduction(norm_type))


def _vector_norm_strategy(op_schema: Any) -> Any:
    from torch.distributed.tensor._ops._math_ops import _infer_reduction_dims

    args = op_schema.args_schema
    input_strategy = args[0]
    dims = _infer_reduction_dims(args[2] if len(args) > 2 else None, input_strategy.ndim)
    reduce_dims = list(range(input_strategy.ndim)) if dims is None else dims
    return _norm_reduction(input_strategy, reduce_dims, bool(args[3]) if len(args) > 3 else False,
                           args[1] if len(args) > 1 else 2)


def _foreach_norm_strategy(op_schema: Any) -> Any:
    from torch.distributed.tensor._op_schema import TupleStrategy

    args = op_schema.args_schema
    norm_type = args[1] if len(args) > 1 else 2
    return TupleStrategy([_norm_reduction(child, list(range(child.ndim)), False, norm_type)
                          for child in args[0].children])


def _logsumexp_strategy(op_schema: Any) -> Any:
    from torch.distributed.tensor._ops._math_ops import _infer_reduction_dims, common_reduction_strategy

    args = op_schema.args_schema
    input_strategy = args[0]
    dims = _infer_reduction_dims(args[1], input_strategy.ndim) if len(args) > 1 else None
    reduce_dims = list(range(input_strategy.ndim)) if dims is None else dims
    keep_dim = len(args) > 2 and bool(args[2])
    return common_reduction_strategy(input_strategy, reduce_dims, keep_dim=keep_dim, reduction_linear=False)


def _check_no_mask(op_schema: Any) -> None:
    if op_schema.kwargs_schema.get("attn_mask") is not None:
        raise NotImplementedError(
            "ember's DTensor rule for CPU scaled_dot_product_attention takes no attn_mask (DTensor cannot place a "
            "keyword tensor); ember.models.layers.dot_product_attention computes masked attention explicitly under DTensor."
        )


def _sdpa_cpu_strategy(op_schema: Any) -> Any:
    """[output, logsumexp, q, k, v]: all replicated, all split on heads (dim 1), or on batch (dim 0)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    _check_no_mask(op_schema)
    per_dim = [[Replicate()] * 5, [Shard(1)] * 5, [Shard(0)] * 5]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, per_dim, input_index=2)


def _sdpa_cpu_backward_strategy(op_schema: Any) -> Any:
    """[grad_q, grad_k, grad_v, grad_out, q, k, v, out, logsumexp]: as the forward."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    _check_no_mask(op_schema)
    per_dim = [[Replicate()] * 9, [Shard(1)] * 9, [Shard(0)] * 9]
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, per_dim, input_index=3)


def _single_dim_gather_without_mask_partial(original: Any) -> Any:
    def gather_single_dim_strategy(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor._ops._embedding_ops import _MaskPartial

        rows = original(*args, **kwargs)
        return [row for row in rows if not any(isinstance(p, _MaskPartial) for p in row)]

    return gather_single_dim_strategy


def install() -> None:
    """Register the rules above on DTensor's sharding propagator (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    aten = torch.ops.aten
    prop = DTensor._op_dispatcher.sharding_propagator
    per_dim = getattr(prop, "op_single_dim_strategy_funcs", {})  # torch >= 2.10

    def has_rule(op: Any) -> bool:
        return op in prop.op_strategy_funcs or op in per_dim

    if aten.gather.default in per_dim:
        info = per_dim[aten.gather.default]
        per_dim[aten.gather.default] = dataclasses.replace(
            info, func=_single_dim_gather_without_mask_partial(info.func))
    elif aten.gather.default in prop.op_strategy_funcs:
        prop.op_strategy_funcs[aten.gather.default] = _gather_without_mask_partial(
            prop.op_strategy_funcs[aten.gather.default])
    if aten.select.int in prop.op_strategy_funcs and aten.select.int not in per_dim:
        prop.op_strategy_funcs[aten.select.int] = _select_with_fresh_output(prop.op_strategy_funcs[aten.select.int])
    if aten.linalg_vector_norm.default not in per_dim:
        prop.op_strategy_funcs[aten.linalg_vector_norm.default] = _vector_norm_strategy
    if aten._foreach_norm.Scalar not in per_dim:
        prop.op_strategy_funcs[aten._foreach_norm.Scalar] = _foreach_norm_strategy
    if not has_rule(aten.logsumexp.default):
        prop.register_op_strategy(aten.logsumexp.default, _logsumexp_strategy, schema_info=RuntimeSchemaInfo(1))
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if not has_rule(fwd):
        prop.register_op_strategy(fwd, _sdpa_cpu_strategy, schema_info=RuntimeSchemaInfo(3, ["scale"]))
    if not has_rule(bwd):
        prop.register_op_strategy(bwd, _sdpa_cpu_backward_strategy, schema_info=RuntimeSchemaInfo(6, ["scale"]))
    prop.propagate_op_sharding.cache.cache_clear()  # drop entries a buggy select may have rewritten
    _INSTALLED = True
