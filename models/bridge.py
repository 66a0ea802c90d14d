"""`from_torch`: use any `torch.nn.Module` as an ember model (`init` / `apply` / `axes`).

Public names: `from_torch`, `TorchModel`, `axes_from_rules`, `HF_GPT2_AXES_RULES`,
`HF_LLAMA_AXES_RULES`.

The bridge calls the module functionally with `torch.func.functional_call`, so its weights come
from the params pytree passed to `apply` and never from the module itself:

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

import re
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..core import pytree
from ..core.types import Key, LogicalAxes, Params, PyTree

__all__ = [
    "HF_GPT2_AXES_RULES",
    "HF_LLAMA_AXES_RULES",
    "TorchModel",
    "axes_from_rules",
    "from_torch",
]

AxesRule = Tuple[str, LogicalAxes]
"""`(regex, axes)`: parameters whose dotted name matches `regex` (`re.search`) get `axes`."""

DefaultAxes = Union[LogicalAxes, Literal["replicated"], None]

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

_MSG_UNPLACED = (
    "parameter '{name}' (shape {shape}) matches none of the axes rules, and no default_axes was "
    "given. Rules, in order:\n{rules}\nAdd a rule whose regex matches '{name}' (matched with "
    "re.search against the dotted name), or pass default_axes=(...) or "
    "default_axes='replicated' to from_torch."
)


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


def _check_rules(rules: Sequence[Any]) -> List[Tuple[re.Pattern, LogicalAxes, str]]:
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(
            f"axes_rules must be a list of (regex, axes_tuple) pairs, got {type(rules).__name__}, "
            f"e.g. [(r'\\.q_proj\\.weight$', ('heads', 'embed'))]."
        )
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
                and isinstance(rule[1], tuple)):
            raise TypeError(
                f"axes_rules[{i}] must be a (regex: str, axes: tuple) pair, got {rule!r}, e.g. "
                f"(r'\\.q_proj\\.weight$', ('heads', 'embed'))."
            )
        pattern, axes = rule
        if not all(a is None or isinstance(a, str) for a in axes):
            raise TypeError(f"axes_rules[{i}] axes {axes!r} must hold str or None per dimension.")
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"axes_rules[{i}] regex {pattern!r} does not compile: {e}.") from e
        out.append((compiled, tuple(axes), pattern))
    return out


def axes_from_rules(
    shapes: Mapping[str, Sequence[int]],
    rules: Sequence[AxesRule],
    *,
    default_axes: DefaultAxes = None,
) -> Dict[str, LogicalAxes]:
    """Logical axes for each named parameter from ordered path-pattern rules (first match wins).

    Args:
        shapes: dotted parameter name -> shape.
        rules: ordered `(regex, axes)` pairs; the regex is `re.search`ed in the dotted name and
            `axes` needs one name (or None) per dimension.
        default_axes: axes for a parameter no rule matches: a tuple (its length must equal the
            parameter's rank), `"replicated"` (all None), or None to raise.

    Returns:
        Dotted name -> axes tuple, in the order of `shapes`.

    Raises:
        ValueError: a parameter matches no rule and there is no default (the message names it and
            lists the rules), or a matched rule / the default has the wrong number of axes.
        TypeError: a rule is not a `(str, tuple)` pair.

    Example:
        >>> axes_from_rules({"fc.weight": (8, 4), "fc.bias": (8,)}, [(r"weight$", ("mlp", "embed"))],
        ...                 default_axes="replicated")
        {'fc.weight': ('mlp', 'embed'), 'fc.bias': (None,)}
    """
    compiled = _check_rules(rules)
    if isinstance(default_axes, str) and default_axes != "replicated":
        raise ValueError(f"default_axes must be a tuple, 'replicated' or None, got {default_axes!r}.")
    if default_axes is not None and default_axes != "replicated" and not isinstance(default_axes, tuple):
        raise TypeError(
            f"default_axes must be a tuple of axis names, 'replicated' or None, got {default_axes!r}."
        )
    out: Dict[str, LogicalAxes] = {}
    for name, shape in shapes.items():
        ndim = len(shape)
        for regex, axes, pattern in compiled:
            if regex.search(name):
                if len(axes) != ndim:
                    raise ValueError(
                        f"axes rule ({pattern!r}, {axes}) gives {len(axes)} axes to parameter '{name}' of "
                        f"shape {tuple(shape)} ({ndim} dims); give one axis name (or None) per dimension, "
                        f"or make the regex stricter so it does not match '{name}'."
                    )
                out[name] = axes
                break
        else:
            if default_axes is None:
                listing = "\n".join(f"  {i}: ({p!r}, {a})" for i, (_, a, p) in enumerate(compiled)) or "  (none)"
                raise ValueError(_MSG_UNPLACED.format(name=name, shape=tuple(shape), rules=listing))
            if default_axes == "replicated":
                out[name] = (None,) * ndim
            elif len(default_axes) != ndim:
                raise ValueError(
                    f"default_axes {default_axes} has {len(default_axes)} axes but parameter '{name}' has "
                    f"shape {tuple(shape)} ({ndim} dims); add a rule for '{name}' or use "
                    f"default_axes='replicated'."
                )
            else:
                out[name] = default_axes
    return out


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
    ) -> None:
        self.module = module
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
        return torch.func.functional_call(
            self.module, {**flat, **self.buffers}, tuple(args), kwargs, tie_weights=True, strict=True
        )

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

    Returns:
        `(model, params)`: a `TorchModel` and a nested dict of detached parameter clones.

    Raises:
        TypeError: `module` is not an `nn.Module`, or a rule is malformed.
        ValueError: a rule leaves a parameter unplaced (no match, no default) or has the wrong
            number of axes for it.

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
    model = TorchModel(module, axes_rules=axes_rules, default_axes=default_axes)
    return model, model.init()
