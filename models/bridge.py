"""`from_torch`: use any `torch.nn.Module` as an ember model (`init` / `apply` / `axes`).

Public names: `from_torch`, `TorchModel`, `axes_from_rules`, `HF_GPT2_AXES_RULES`,
`HF_LLAMA_AXES_RULES`.

The bridge calls the module functionally, as `torch.func.functional_call` does, so its weights come
from the params pytree passed to `apply` and never from the module itself. Inside an ember gradient
the weights stay swapped in until the backward is done, so a `torch.utils.checkpoint` in the module
(transformers' `gradient_checkpointing_enable()`, with `eval_mode=False`) recomputes with them:

- **Params** are a nested dict keyed by module path, like every ember model's tree
  (`{"transformer": {"h": {"0": {"attn": {"c_attn": {"weight": T}}}}}}`), so a leaf's dotted pytree
  path is exactly its torch name (`"transformer.h.0.attn.c_attn.weight"`). They are detached clones
  of the module's parameters (tied parameters appear once, under their first name; frozen ones,
  `requires_grad=False`, are included).
- **Buffers** (running statistics, causal masks, rotary tables; persistent or not) are not params:
  they are detached clones held by the model (`model.buffers`, flat by torch name) and passed to
  every call as constants. A module that writes its buffers in `forward` (BatchNorm in train mode)
  is not pure; use it in eval mode.
- **`init(key)`** returns a fresh copy of the module's parameters as they were when `from_torch`
  was called: the key is accepted for the interface and ignored (the module was initialised by
  torch already; seed it with `torch.manual_seed` before building it). Nothing is re-initialised.
- **Randomness**: a torch module draws dropout masks from torch's global RNG, which a pure step
  must never use. `from_torch` therefore puts the module in eval mode (`module.eval()`, dropout
  off, running statistics used) unless `eval_mode=False`; `apply`'s `key` is accepted and ignored.
  For training with dropout, write the model in ember's layer DSL (keyed dropout) or set the
  module's dropout probabilities to 0.
- **Axes** come from path-pattern rules, an ordered list of `(regex, axes)`; a parameter takes the
  axes of the first rule whose regex `re.search`es its dotted name. A parameter that no rule
  matches takes `default_axes` (a tuple, or `"replicated"` for all-None axes) or raises a
  `ValueError` naming it and listing the rules. Without rules every parameter is replicated.

Example:
    >>> import torch
    >>> from ember.models.bridge import from_torch
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> model, params = from_torch(net, axes_rules=[(r"0\\.weight$", ("mlp", "embed")),
    ...                                             (r"2\\.weight$", ("embed", "mlp"))],
    ...                            default_axes="replicated")
    >>> {k: tuple(v.shape) for k, v in params["0"].items()}
    {'weight': (8, 4), 'bias': (8,)}
    >>> model.axes["2"]
    {'weight': ('embed', 'mlp'), 'bias': (None,)}
    >>> x = torch.randn(3, 4)
    >>> torch.equal(model.apply(params, x), net(x))
    True
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import pytree
from ..core.trace_context import held_through_backward
from ..core.compat.stateless import reparametrized
from ..core.partition_specs.path_rules import AxesRule, DefaultAxes, axes_from_rules
from ..core.types import Key, Params, PyTree
from .bridge_remat import RematRules, check_remat_rules, remat_submodules

__all__ = [
    "HF_GPT2_AXES_RULES",
    "HF_LLAMA_AXES_RULES",
    "TorchModel",
    "axes_from_rules",
    "from_torch",
]


HF_GPT2_AXES_RULES: List[AxesRule] = [
    # Hugging Face GPT2LMHeadModel. Conv1D weights are stored (in, out), the transpose of nn.Linear.
    (r"(^|\.)wte\.weight$", ("vocab", "embed")),
    (r"(^|\.)wpe\.weight$", (None, "embed")),
    # c_attn fuses q|k|v along its output dim: sharding it by heads would split q from k and v,
    # so that dim is left unnamed.
    (r"\.attn\.c_attn\.weight$", ("embed", None)),
    (r"\.attn\.c_attn\.bias$", (None,)),
    (r"\.attn\.c_proj\.weight$", ("heads", "embed")),
    (r"\.mlp\.c_fc\.weight$", ("embed", "mlp")),
    (r"\.mlp\.c_fc\.bias$", ("mlp",)),
    (r"\.mlp\.c_proj\.weight$", ("mlp", "embed")),
    (r"(^|\.)(c_proj|ln_1|ln_2|ln_f)\.(weight|bias)$", ("embed",)),
    (r"^lm_head\.weight$", ("vocab", "embed")),  # only when untied
]
"""Axes rules for `transformers.GPT2LMHeadModel` parameter names (same logical names as ember's GPT2)."""

HF_LLAMA_AXES_RULES: List[AxesRule] = [
    # Hugging Face LlamaForCausalLM: nn.Linear weights are (out, in), as in ember's Llama3.
    (r"embed_tokens\.weight$", ("vocab", "embed")),
    (r"self_attn\.q_proj\.weight$", ("heads", "embed")),
    (r"self_attn\.[kv]_proj\.weight$", ("kv_heads", "embed")),
    (r"self_attn\.o_proj\.weight$", ("embed", "heads")),
    (r"mlp\.(gate|up)_proj\.weight$", ("mlp", "embed")),
    (r"mlp\.down_proj\.weight$", ("embed", "mlp")),
    (r"(input_layernorm|post_attention_layernorm|norm)\.weight$", ("embed",)),
    (r"^lm_head\.weight$", ("vocab", "embed")),
]
"""Axes rules for `transformers.LlamaForCausalLM` parameter names (same logical names as ember's Llama3)."""

def _nest(flat: Mapping[str, Any]) -> Dict[str, Any]:
    """`{"a.b.c": x}` -> `{"a": {"b": {"c": x}}}`, keeping insertion order."""
    out: Dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _flatten(params: Params) -> Dict[str, Tensor]:
    """The inverse of `_nest`: dotted names -> leaves."""
    return dict(pytree.tree_leaves_with_path(params))


class TorchModel:
    """An `nn.Module` behind ember's model interface; build it with `from_torch`.

    Attributes:
        module: the wrapped module (its own parameters are never read by `apply`).
        buffers: dotted name -> detached clone of each buffer, passed to every call as a constant.
        axes: nested dict of logical axes, shaped like the params.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        axes_rules: Optional[Sequence[AxesRule]] = None,
        default_axes: DefaultAxes = None,
        remat: Optional[RematRules] = None,
    ) -> None:
        self.module = module
        self._remat = check_remat_rules(module, remat) if remat else []
        self._initial = {n: p.detach().clone() for n, p in module.named_parameters()}
        self.buffers: Dict[str, Tensor] = {n: b.detach().clone() for n, b in module.named_buffers()}
        # every name (aliases of tied parameters included) -> the name the params tree uses
        self._aliases = {}
        first_name: Dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self._aliases[name] = first_name.setdefault(id(p), name)
        shapes = {n: tuple(p.shape) for n, p in self._initial.items()}
        if axes_rules is None:
            flat_axes = axes_from_rules(shapes, [], default_axes=default_axes or "replicated")
        else:
            flat_axes = axes_from_rules(shapes, axes_rules, default_axes=default_axes)
        self._axes = _nest(flat_axes)

    def __repr__(self) -> str:
        return f"TorchModel({type(self.module).__name__}, {len(self._initial)} parameters, {len(self.buffers)} buffers)"

    @property
    def axes(self) -> PyTree:
        """Logical axis names, a nested dict like the params with one tuple per parameter."""
        return self._axes

    def init(self, key: Optional[Key] = None) -> Params:
        """A fresh copy of the module's parameters as they were at `from_torch` time.

        Args:
            key: ignored (torch initialised the module already); accepted for the model interface.

        Returns:
            A nested dict keyed by module path (see the module docstring).
        """
        del key
        return _nest({n: p.clone() for n, p in self._initial.items()})

    def param_shapes(self) -> Params:
        """Meta tensors with every parameter's shape and dtype, shaped like `init`'s result."""
        return _nest({n: torch.empty_like(p, device="meta") for n, p in self._initial.items()})

    def apply(self, params: Params, *args: Any, key: Optional[Key] = None, **kwargs: Any) -> Any:
        """Call the module on `args` / `kwargs` with the weights in `params` (functionally).

        Args:
            params: a tree shaped like `init`'s result.
            *args: positional inputs of the module's `forward`.
            key: ignored: torch modules draw randomness from the global RNG, so the bridge runs
                them in eval mode (see the module docstring).
            **kwargs: keyword inputs of `forward` (e.g. Hugging Face `input_ids=`, `labels=`).

        Returns:
            Whatever the module's `forward` returns.

        Raises:
            ValueError: `params` lacks a parameter of the module or has one it does not know.
        """
        del key
        flat = _flatten(params)
        unknown = [n for n in flat if n not in self._initial]
        missing = [n for n in self._initial if n not in flat]
        if unknown or missing:
            raise ValueError(
                f"params do not match {type(self.module).__name__}'s parameters: missing "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unknown {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''}. Start from model.init() and keep its tree."
            )
        # Held through an ember gradient's backward: a torch.utils.checkpoint inside the module
        # (transformers' gradient_checkpointing_enable()) recomputes there with these weights.
        with remat_submodules(self.module, self._remat), \
                held_through_backward(reparametrized(self.module, {**flat, **self.buffers})):
            return self.module(*args, **kwargs)

    def state_dict(self, params: Params) -> Dict[str, Tensor]:
        """A torch `state_dict` for the module: `params` (under every tied name) plus persistent buffers.

        `module.load_state_dict(model.state_dict(params))` loads trained weights back into the module.

        Args:
            params: a tree shaped like `init`'s result.

        Returns:
            Dotted name -> tensor, with exactly the keys of `module.state_dict()`.
        """
        flat = _flatten(params)
        out: Dict[str, Tensor] = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            if name in self._aliases:
                out[name] = flat[self._aliases[name]]
            elif name in self.buffers:
                out[name] = self.buffers[name]
            else:  # extra state (`get_extra_state`): the module's own
                out[name] = value
        return out


def from_torch(
    module: torch.nn.Module,
    *,
    axes_rules: Optional[Sequence[AxesRule]] = None,
    default_axes: DefaultAxes = None,
    eval_mode: bool = True,
    remat: Optional[RematRules] = None,
) -> Tuple[TorchModel, Params]:
    """Wrap `module` as an ember model and return it with a copy of its parameters.

    Args:
        module: any `torch.nn.Module`; its parameters and buffers should be on the device where
            `apply` will run (move it with `module.to(device)` first).
        axes_rules: ordered `(regex, axes)` pairs giving each parameter's logical axes (first
            `re.search` match wins), e.g. `HF_LLAMA_AXES_RULES`. None: every parameter gets
            `default_axes`, or is replicated.
        default_axes: axes of a parameter no rule matches: a tuple, `"replicated"`, or None to
            raise `ValueError` for it.
        eval_mode: call `module.eval()` (dropout off; required for a pure step, since torch's
            dropout uses the global RNG). False leaves the module's mode as it is.
        remat: `{regex: policy}`: submodules whose whole dotted name matches (a model's blocks, e.g.
            `{r"model\\.layers\\.\\d+": "full"}`) recompute their activations in the backward pass
            (`ember.core.remat`; policies as in `ember.core.remat_policies`).

    Returns:
        `(model, params)`: a `TorchModel` and a nested dict of detached parameter clones.

    Raises:
        TypeError: `module` is not an `nn.Module`, or a rule is malformed.
        ValueError: a rule leaves a parameter unplaced (no match, no default) or has the wrong
            number of axes for it; a remat rule matches no submodule or names an unknown policy.

    Example:
        >>> import torch
        >>> model, params = from_torch(torch.nn.Linear(3, 2))
        >>> model.axes
        {'weight': (None, None), 'bias': (None,)}
        >>> model.apply(params, torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}.")
    if eval_mode:
        module.eval()
    model = TorchModel(module, axes_rules=axes_rules, default_axes=default_axes, remat=remat)
    return model, model.init()
