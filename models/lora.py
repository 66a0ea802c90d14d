"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") as a model converter.

Public names: `to_lora`, `LoRAModel`, `LoRAConfig`, `lora_init`, `merge_lora`, `lora_mask`, `lora_targets`.

Each targeted weight `W` of shape `(out, in)` (or `(L, out, in)` for `scan_layers` stacks) gets two
factors `A: (r, in)` and `B: (out, r)`, and the model computes with

    W_eff = W + (alpha / r) * B @ A                               (paper eq. 3, scaled as in §4.1)

`A` starts uniform in `[-1/sqrt(in), 1/sqrt(in)]` (PEFT's `kaiming_uniform_(a=sqrt(5))`) and `B` at
zero, so the converted model starts exactly equal to the base. Everything is a pure function of
pytrees: `to_lora(model)` returns a `LoRAModel` whose params are `{"base": params, "lora": lora}`
and whose `apply` merges the factors into the weights functionally before calling the base model
(traceable; it costs one extra weight-sized tensor per targeted matrix, never touches activations,
and works for any model, ember's or bridged). The LoRA tree mirrors the params tree, keeping only
the targeted weights, each replaced by `{"a": A, "b": B}`: `blocks.attn.wq.weight.a` (stacked blocks: a
factor per layer, `(L, r, in)`).

Freezing the base takes two things: `apply` detaches the base weights (their gradients are exact
zeros, and no weight gradient is computed for them), and the optimizer updates only the LoRA
leaves: `optim.masked(optim.adamw(...), lora_mask(params))` (masked-out updates pass through
unchanged, and they are zeros). `merge_lora` gives plain base-model params for export (`to_hf`).
`LoRAConfig` is the run config's `lora` group (`launch/train.py --lora.rank 8 --lora.targets wq wv`).

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> from ember.models.lora import lora_mask, merge_lora, to_lora
    >>> base = build_model("llama3", "tiny")
    >>> model = to_lora(base, rank=4, alpha=8.0, targets=("wq", "wv"))
    >>> params = model.init(random.key(0))
    >>> tuple(params["lora"]["blocks"]["attn"]["wq"]["weight"]["a"].shape)
    (2, 4, 128)
    >>> lora_mask(params)["lora"]["blocks"]["attn"]["wv"]["weight"]
    {'a': True, 'b': True}
    >>> tokens = torch.zeros(1, 8, dtype=torch.long)
    >>> torch.equal(model.apply(params, tokens), base.apply(params["base"], tokens))  # B = 0
    True
    >>> merged = merge_lora(params["base"], params["lora"], alpha=8.0)
    >>> torch.equal(base.apply(merged, tokens), model.apply(params, tokens))
    True
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..core import pytree, random
from ..core.config_checks import check_fields, finite_positive, non_negative_int
from ..core.types import Key, Params, PyTree
from .layers.module import path_key

__all__ = ["LoRAConfig", "LoRAModel", "lora_init", "lora_mask", "lora_targets", "merge_lora", "to_lora"]

Targets = Union[Sequence[str], str]
"""Layer names (the path component before `.weight`, e.g. `("wq", "wv")` or `("q_proj",)`), or a
regex `re.search`ed in the weight's dotted path (e.g. `r"attn\\.w[qkv]"`)."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """A run's LoRA adapters (`--lora.rank 8 --lora.alpha 16 --lora.targets wq wv`); rank 0 trains every weight."""

    rank: int = 0
    """r, the adapters' inner dimension; 0: no LoRA (every weight trains)."""
    alpha: float = 16.0
    """Scale numerator: the adapters add (alpha / rank) * B @ A to each targeted weight."""
    targets: Tuple[str, ...] = ("wq", "wv")
    """Layers to adapt: names before `.weight` (wq wk wv wo gate up down), or regexes on the dotted weight path."""

    def __post_init__(self) -> None:
        check_fields(self, "lora.", rank=non_negative_int, alpha=finite_positive)
        if isinstance(self.targets, str) or not self.targets:
            raise ValueError(f"lora.targets={self.targets!r}: expected one or more layer names; pass e.g. "
                             f"--lora.targets wq wv.")

    def pattern(self) -> Targets:
        """`targets` for `to_lora`: the names as they are, or one regex when any of them is a regex."""
        names = tuple(self.targets)
        if all(t.isidentifier() for t in names):
            return names
        return "|".join(f"(?:^|\\.){t}\\.weight$" if t.isidentifier() else f"(?:{t})" for t in names)


def _check_targets(targets: Any) -> None:
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise ValueError(f"LoRA targets regex {targets!r} does not compile: {e}.") from e
    elif not (isinstance(targets, (tuple, list)) and targets and all(isinstance(t, str) for t in targets)):
        raise TypeError(
            f"LoRA targets must be a non-empty tuple of layer names such as ('wq', 'wv') or a regex "
            f"string, got {targets!r}."
        )


def _is_target(path: str, ndim: int, targets: Targets) -> bool:
    parts = path.split(".")
    if ndim < 2 or parts[-1] != "weight" or len(parts) < 2:
        return False
    if isinstance(targets, str):
        return re.search(targets, path) is not None
    return parts[-2] in targets


def lora_targets(params: Params, targets: Targets = ("wq", "wv")) -> List[str]:
    """Dotted paths of the weights LoRA adapts: `.weight` leaves of rank >= 2 selected by `targets`.

    Args:
        params: a params tree (meta tensors work).
        targets: layer names (the component before `.weight`) or a regex on the dotted path.

    Returns:
        The matching paths, in tree order.

    Raises:
        ValueError: nothing matches (the message lists the candidate layer names).

    Example:
        >>> from ember.models import build_model
        >>> lora_targets(build_model("llama3", "tiny").param_shapes(), ("wq",))
        ['blocks.attn.wq.weight']
    """
    _check_targets(targets)
    leaves = pytree.tree_leaves_with_path(params)
    found = [p for p, t in leaves if _is_target(p, t.dim(), targets)]
    if not found:
        names = sorted({p.split(".")[-2] for p, t in leaves if t.dim() >= 2 and p.endswith(".weight")})
        stacks = [(p, t) for p, t in leaves if t.dim() >= 2 and not p.endswith(".weight")
                  and _is_target(p + ".weight", t.dim(), targets)]
        why = ""
        if stacks:
            path, t = stacks[0]
            why = (f" {path} {tuple(t.shape)} is a stacked tensor (as a mixture's experts are stored), not a "
                   f"layer's `.weight`, and LoRA adapts only those;")
        raise ValueError(
            f"LoRA targets {targets!r} match no layer's `.weight` matrix;{why} the model's adaptable layers are "
            f"named {names}. Pass some of these names, or a regex on dotted paths."
        )
    return found


def _mirror(node: Any, path: str, fn: Callable[[str, Tensor], Optional[Any]]) -> Any:
    """A tree shaped like `node` with `fn(path, leaf)` at each leaf it keeps (None drops the leaf).

    Dicts lose the keys whose subtree is empty; lists keep their length (empty entries are `{}`),
    so indices and dotted paths stay those of the params.
    """
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            sub = _mirror(v, f"{path}.{k}" if path else str(k), fn)
            if sub is not None:
                out[k] = sub
        return out or None
    if isinstance(node, (list, tuple)):
        subs = [_mirror(v, f"{path}.{i}" if path else str(i), fn) for i, v in enumerate(node)]
        return None if all(s is None for s in subs) else [{} if s is None else s for s in subs]
    return fn(path, node)


def lora_init(
    params: Params,
    *,
    key: Key,
    rank: int,
    targets: Targets = ("wq", "wv"),
    dtype: Optional[torch.dtype] = None,
) -> Params:
    """LoRA factors for the targeted weights of `params`: `A` uniform(+-1/sqrt(in)), `B` zeros.

    Args:
        params: the base model's params (`(..., out, in)` weights; leading dims are layer stacks).
        key: ember key; each weight's `A` uses `fold_in(key, hash(path))`, so it depends on the path only.
        rank: r, the inner dimension of the factors.
        targets: layer names or a regex (see `lora_targets`).
        dtype: factor dtype; None uses each weight's dtype.

    Returns:
        A tree mirroring `params` with only the targeted weights, each `{"a": (..., r, in), "b": (..., out, r)}`.

    Raises:
        ValueError: `rank` is not a positive int, or nothing matches `targets`.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"LoRA rank must be a positive int, got {rank!r}.")
    chosen = set(lora_targets(params, targets))

    def make(path: str, w: Tensor) -> Optional[Dict[str, Tensor]]:
        if path not in chosen:
            return None
        *lead, out_f, in_f = w.shape
        dt = dtype or w.dtype
        bound = 1.0 / math.sqrt(in_f)
        k = path_key(key.to(w.device), path)
        a = random.uniform(k, (*lead, rank, in_f), dtype=torch.float32, minval=-bound, maxval=bound).to(dt)
        return {"a": a, "b": torch.zeros((*lead, out_f, rank), dtype=dt, device=w.device)}

    return _mirror(params, "", make) or {}


def _scale(alpha: float, a: Tensor) -> float:
    return float(alpha) / a.shape[-2]


def merge_lora(params: Params, lora: Params, *, alpha: float) -> Params:
    """Base params with each adapted weight replaced by `W + (alpha / r) * B @ A` (pure, traceable).

    Args:
        params: the base model's params.
        lora: factors from `lora_init` (any subset of the weights; r is read from `A`'s shape).
        alpha: the LoRA scale numerator (the adapter scale is `alpha / r`).

    Returns:
        A new params tree for the base model; leaves without factors are the same tensors.

    Raises:
        ValueError: `lora` has a path that `params` lacks, or factor shapes do not fit the weight.
    """

    def walk(p: Any, l: Any, path: str) -> Any:
        if isinstance(l, dict) and set(l) == {"a", "b"} and isinstance(l["a"], Tensor):
            if not isinstance(p, Tensor):
                raise ValueError(f"LoRA factors at '{path}' but the params hold a {type(p).__name__} there.")
            a, b = l["a"], l["b"]
            want_a, want_b = (*p.shape[:-2], a.shape[-2], p.shape[-1]), (*p.shape[:-1], a.shape[-2])
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(
                    f"LoRA factors at '{path}' have shapes a={tuple(a.shape)}, b={tuple(b.shape)}; weight "
                    f"{tuple(p.shape)} needs a={want_a}, b={want_b}."
                )
            delta = torch.matmul(b, a) * _scale(alpha, a)  # (..., out, r) @ (..., r, in) -> (..., out, in)
            return p + delta.to(p.dtype)
        if isinstance(l, dict):
            if not isinstance(p, dict) or any(k not in p for k in l):
                missing = [k for k in l if not isinstance(p, dict) or k not in p]
                raise ValueError(f"LoRA tree has {missing[:5]} under '{path or '<root>'}', which the params lack.")
            return {k: walk(v, l[k], f"{path}.{k}" if path else k) if k in l else v for k, v in p.items()}
        if isinstance(l, list):
            if not isinstance(p, (list, tuple)) or len(p) != len(l):
                raise ValueError(f"LoRA tree has a list of {len(l)} at '{path or '<root>'}', the params do not.")
            return type(p)(walk(v, lv, f"{path}.{i}" if path else str(i)) for i, (v, lv) in enumerate(zip(p, l)))
        raise ValueError(f"LoRA tree has a {type(l).__name__} at '{path or '<root>'}'; expected dicts of factors.")

    return walk(params, lora, "")


def lora_mask(params: Params) -> PyTree:
    """Optimizer mask for `{"base": ..., "lora": ...}` params: False on every base leaf, True on LoRA.

    Use as `optim.masked(optim.adamw(lr), lora_mask(params))` so only the factors are updated.

    Raises:
        ValueError: `params` is not a dict with exactly the keys "base" and "lora".
    """
    if not isinstance(params, dict) or set(params) != {"base", "lora"}:
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"lora_mask expects LoRAModel params {{'base': ..., 'lora': ...}}, got {got}.")
    return {
        "base": pytree.tree_map(lambda _: False, params["base"]),
        "lora": pytree.tree_map(lambda _: True, params["lora"]),
    }


@dataclasses.dataclass(frozen=True)
class LoRAModel:
    """A model whose targeted weights carry LoRA factors; params are `{"base": ..., "lora": ...}`.

    Attributes:
        base: the wrapped model (`init`, `apply`, `axes`, `param_shapes`): ember's or bridged.
        rank: r.
        alpha: adapter scale numerator; the delta is `(alpha / r) * B @ A`.
        targets: layer names or a regex choosing the adapted weights.
        freeze_base: detach the base weights in `apply` (no gradient flows to them).
    """

    base: Any
    rank: int = 8
    alpha: float = 16.0
    targets: Targets = ("wq", "wv")
    freeze_base: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRAModel.rank must be a positive int, got {self.rank!r}.")
        if not self.alpha > 0:
            raise ValueError(f"LoRAModel.alpha must be > 0, got {self.alpha!r}.")
        for name in ("init", "apply", "axes", "param_shapes"):
            if not hasattr(self.base, name):
                raise TypeError(f"LoRAModel.base must be a model with `{name}`, got {type(self.base).__name__}.")
        if isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))
        lora_targets(self.base.param_shapes(), self.targets)  # fails early when nothing matches

    def init(self, key: Key) -> Params:
        """`{"base": base.init(k1), "lora": lora_init(...)}` with `k1, k2 = split(key)`."""
        k_base, k_lora = random.split(key)
        return self.init_from(self.base.init(k_base), key=k_lora)

    def init_from(self, base_params: Params, *, key: Key) -> Params:
        """Add fresh factors to existing (e.g. pretrained) base params: `{"base": base_params, "lora": ...}`."""
        return {"base": base_params, "lora": lora_init(base_params, key=key, rank=self.rank, targets=self.targets)}

    def param_shapes(self) -> Params:
        """Meta tensors of the base params and the factors."""
        base = self.base.param_shapes()
        return {"base": base, "lora": lora_init(base, key=random.key(0, device="meta"), rank=self.rank, targets=self.targets)}

    @property
    def axes(self) -> PyTree:
        """Base axes, and for each factor the weight's axes with the rank dim unnamed.

        A weight with axes `(..., out, in)` gives `a: (..., None, in)` and `b: (..., out, None)`.
        """
        leaves, _ = pytree.tree_flatten_with_path(self.base.axes, is_leaf=lambda x: isinstance(x, tuple))
        by_path = {pytree.keystr(p): ax for p, ax in leaves}
        shapes = self.base.param_shapes()

        def factor_axes(path: str, _: Tensor) -> Optional[Dict[str, Tuple]]:
            ax = by_path[path]
            return {"a": (*ax[:-2], None, ax[-1]), "b": (*ax[:-1], None)}

        chosen = set(lora_targets(shapes, self.targets))
        lora_axes = _mirror(shapes, "", lambda p, t: factor_axes(p, t) if p in chosen else None) or {}
        return {"base": self.base.axes, "lora": lora_axes}

    def merged(self, params: Params) -> Params:
        """The base model's params with the factors merged in (for export: `to_hf(model.base, model.merged(p), path)`)."""
        return merge_lora(params["base"], params["lora"], alpha=self.alpha)

    def apply(self, params: Params, *args: Any, key: Optional[Key] = None, **kwargs: Any) -> Any:
        """The base model's `apply` on `merge_lora(base, lora)`; the base is detached when frozen."""
        return self.base.apply(self._adapted(params), *args, key=key, **kwargs)

    def apply_and_extras(self, params: Params, *args: Any, key: Optional[Key] = None, **kwargs: Any) -> Any:
        """The base model's `apply_and_extras` (logits and router stats of a mixture of experts), as `apply`."""
        return self.base.apply_and_extras(self._adapted(params), *args, key=key, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("auxiliary_loss", "config"):  # the router losses `lm_loss` adds; the architecture
            return getattr(self.base, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _adapted(self, params: Params) -> Params:
        base = params["base"]
        if self.freeze_base:
            base = pytree.tree_map(lambda t: t.detach(), base)
        return merge_lora(base, params["lora"], alpha=self.alpha)


def to_lora(
    model: Any,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Targets = ("wq", "wv"),
    freeze_base: bool = True,
) -> LoRAModel:
    """Convert `model` into a `LoRAModel` (the base is unchanged; params gain a "lora" subtree).

    Args:
        model: any ember model (`init`, `apply`, `axes`, `param_shapes`), including bridged ones.
        rank: r, the factors' inner dimension.
        alpha: scale numerator; the adapter adds `(alpha / r) * B @ A`.
        targets: layer names (ember Llama/GPT-2: "wq", "wk", "wv", "wo", "gate", "up", "down", "fc",
            "proj"; HF Llama: "q_proj", ...) or a regex on dotted weight paths.
        freeze_base: stop gradients into the base weights.

    Returns:
        The `LoRAModel`.

    Raises:
        ValueError: bad rank / alpha, or `targets` matches no weight.
    """
    return LoRAModel(model, rank=rank, alpha=alpha, targets=targets, freeze_base=freeze_base)
