"""Training objectives over ember models.

Public names: `lm_loss`, `check_lm_data`.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("llama3", "tiny")
    >>> params = model.init(random.key(0))
    >>> loss_fn = lm_loss(model)
    >>> batch = {"inputs": torch.zeros(2, 8, dtype=torch.long), "targets": torch.ones(2, 8, dtype=torch.long)}
    >>> loss = loss_fn(params, batch, key=None)
    >>> int(loss.count), loss.mean().shape
    (16, torch.Size([]))
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

from ..core.step_fns.chunked_loss import chunked_cross_entropy
from ..core.step_fns.losses import cross_entropy
from ..core.step_fns.token_loss import TokenLoss
from ..core.types import Batch, Key, Params

__all__ = ["check_lm_data", "lm_loss"]


def lm_loss(model: Any, *, z_loss: float = 0.0, ignore_index: int = -100) -> Callable[..., TokenLoss]:
    """Next-token cross-entropy of `model` on `{"inputs": (B, T), "targets": (B, T)}` batches.

    Extra batch entries (for example `positions` or `segment_ids`) are passed to `model.apply` as
    keyword inputs, so they reach every layer. Targets equal to `ignore_index` count for nothing.
    When the model's config sets `loss_chunk_size`, the head and the loss run chunk by chunk
    (`chunked_cross_entropy`): the whole `(B, T, V)` logits never exist.

    A mixture-of-experts model (one with `auxiliary_loss`, e.g. `ember.models.Qwen3Moe`) adds its
    router losses (load balancing, z-loss) to the total and returns its `moe_*` metrics beside it.
    Its expert biases, whose gradient is each expert's load, are named in the returned function's
    `statistic_leaves` (the model's), so that `train_step` moves them by their rule, not by the optimizer.

    Returns:
        `loss_fn(params, batch, *, key) -> TokenLoss(sum, count)` (or `(TokenLoss, metrics)` for a
        mixture of experts): `train_step` divides the summed loss by the valid tokens of the whole
        step, whatever the microbatches or mesh.
    """

    chunk_size = loss_chunk_size(model)
    routed = callable(getattr(model, "auxiliary_loss", None))  # a mixture of experts: router losses and metrics

    def loss_fn(params: Params, batch: Batch, *, key: Key | None) -> Any:
        tokens, extra = batch["inputs"], {k: v for k, v in batch.items() if k not in ("inputs", "targets")}
        out, router_stats = forward_for_loss(model, params, tokens, key=key, chunked=bool(chunk_size), **extra)
        if chunk_size:
            name, head = model.head()
            loss = chunked_cross_entropy(head, params[name], out, batch["targets"], chunk_size=chunk_size,
                                         ignore_index=ignore_index, z_loss=z_loss)
        else:
            loss = cross_entropy(out, batch["targets"], ignore_index=ignore_index, z_loss=z_loss,
                                 reduction="sum_and_count")
        if not routed:
            return loss
        extra_total, metrics = model.auxiliary_loss(router_stats, loss.count)
        return TokenLoss(loss.total + extra_total, loss.count), metrics

    return with_statistic_leaves(loss_fn, model)


def loss_chunk_size(model: Any) -> int:
    """The config's `loss_chunk_size` of a model that runs its head apart (`features`, `head`), else 0: a
    LoRA model (whose `apply` merges the adapters into every weight) takes the whole head."""
    size = getattr(getattr(model, "config", None), "loss_chunk_size", 0)
    return size if size and callable(getattr(model, "features", None)) else 0


def forward_for_loss(model: Any, params: Params, tokens: Any, *, key: Key | None, chunked: bool,
                     **extra: Any) -> Tuple[Any, Any]:
    """`(final hidden states (B, T, d) when chunked, else logits (B, T, V); router stats or None)`."""
    routed = callable(getattr(model, "auxiliary_loss", None))
    if chunked:
        run = model.features_and_extras if routed else lambda *a, **k: (model.features(*a, **k), None)
    else:
        run = model.apply_and_extras if routed else lambda *a, **k: (model.apply(*a, **k), None)
    return run(params, tokens, key=key, **extra)


def with_statistic_leaves(loss_fn: Callable[..., Any], model: Any) -> Callable[..., Any]:
    """`loss_fn` carrying the model's `statistic_leaves` (an expert bias moves by its load), for `train_step`."""
    rule = getattr(model, "statistic_leaves", None)
    loss_fn.statistic_leaves = rule() if callable(rule) else None  # type: ignore[attr-defined]
    return loss_fn


def check_lm_data(model: Any, *, seq_len: int, vocab_size: int | None = None) -> None:
    """Raise a ValueError naming the config field to change when data will not fit `model`.

    Args:
        model: a model whose `config` has `max_seq_len` and `vocab_size`.
        seq_len: tokens per training window (`--data.seq_len`).
        vocab_size: the tokenizer's vocabulary size, or None to skip that check.
    """
    cfg = model.config
    if seq_len > cfg.max_seq_len:
        raise ValueError(
            f"data.seq_len={seq_len} is above the model's maximum sequence length "
            f"model.max_seq_len={cfg.max_seq_len}; lower --data.seq_len or raise --model.max_seq_len."
        )
    if vocab_size is not None and vocab_size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab_size} ids but model.vocab_size={cfg.vocab_size}; set "
            f"--model.vocab_size {vocab_size} or more (a multiple of 64 is fastest)."
        )
