"""`Module`: the base of every ember layer (a frozen dataclass of hyperparameters).

Public names: `Module`, `path_key`.

A layer is a config, not a container of tensors. It declares what it owns in `declare()`,
a mapping of name -> `Param` (a parameter) or name -> `Module` (a sub-layer), and computes with a
pure `apply(params, x, *, key=None, **kwargs)`. Composition nests parameters by those names, so a
model's params are a nested dict (lists for `Sequential`) mirroring its layers:

    model.init(key)        -> {"wte": {"weight": T}, "blocks": [{"attn": {"wq": {...}}}, ...], ...}
    model.axes             -> the same tree with a tuple of logical axis names per parameter
    model.param_shapes()   -> the same tree of meta tensors (nothing allocated; for --dry-run)
    model.param_specs()    -> the same tree of `Param` declarations

Each parameter's init key is `fold_in(key, hash(path))` for its dotted path (`"blocks.3.attn.wq.weight"`),
a stable hash, so adding or removing a layer leaves every other parameter's initial value unchanged.
Sub-layers without parameters (dropout, rotary embeddings) are left out of the params tree.

Extra keyword arguments given to `apply` (positions, segment ids, masks: Fast-LLM-style
preprocessing outputs) must reach every layer: a layer's `apply` accepts `**kwargs`, reads what it
needs with `kwargs.get(...)` and passes all of them on, which `Module.call` does for you.

Writing a layer:

    @dataclasses.dataclass(frozen=True)
    class Scale(Module):
        features: int

        def declare(self):
            return {"scale": Param((self.features,), init=inits.ones(), axes=("embed",))}

        def apply(self, params, x, *, key=None, **kwargs):
            return x * params["scale"]              # x: (..., features)

Override `validate()` (not `__post_init__`) to check hyperparameters.
A layer whose `apply` never reads its `key` says `reads_key = False`: no key is folded for it (a
layer that draws, or holds one that does, gets one).

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Linear
    >>> lin = Linear(4, 3, in_axis="embed", out_axis="mlp")
    >>> params = lin.init(random.key(0))
    >>> {k: tuple(v.shape) for k, v in params.items()}
    {'weight': (3, 4), 'bias': (3,)}
    >>> lin.axes
    {'weight': ('mlp', 'embed'), 'bias': ('mlp',)}
    >>> lin.apply(params, torch.ones(2, 4)).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, Mapping, Optional, Union


from ...core import pytree, random
from ...core.partition_specs import constrain, current_sharding
from ...core.types import Key, Params, PyTree
from .param import Param

__all__ = ["Module", "path_key"]


def _stable_hash(text: str) -> int:
    """A 63-bit hash of `text` that is the same in every process (unlike `hash(str)`)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def path_key(key: Key, path: str) -> Key:
    """The init key of the parameter at dotted `path`: `fold_in(key, stable_hash(path))`."""
    return random.fold_in(key, _stable_hash(path))


_RESERVED = frozenset(
    {"apply", "axes", "call", "children", "declare", "draws", "gathered", "has_params", "init", "init_at",
     "param_shapes", "param_specs", "reads_key", "validate"}
)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclasses.dataclass(frozen=True)
class Module:
    """Base class of layers: frozen dataclass hyperparameters + `declare()` + pure `apply()`.

    Subclasses are decorated with `@dataclasses.dataclass(frozen=True)`. After construction the
    declaration is computed once and cached (`children`), so `apply` never rebuilds sub-layers.
    """

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name in _RESERVED:
                raise TypeError(
                    f"{type(self).__name__} has a field named {f.name!r}, which hides Module.{f.name}; "
                    f"rename the field (e.g. 'weight_init' rather than 'init')."
                )
        self.validate()
        children = dict(self.declare())
        for name, child in children.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(
                    f"{type(self).__name__}.declare() names must be non-empty strings without "
                    f"'.', got {name!r}."
                )
            if not isinstance(child, (Param, Module)):
                raise TypeError(
                    f"{type(self).__name__}.declare()[{name!r}] must be a Param or a Module, got "
                    f"{type(child).__name__}."
                )
        has_params = any(isinstance(c, Param) or c.has_params for c in children.values())
        draws = self.reads_key or any(isinstance(c, Module) and c.draws for c in children.values())
        salts = {name: _stable_hash(name) for name in children}
        object.__setattr__(self, "_children", children)
        object.__setattr__(self, "_has_params", has_params)
        object.__setattr__(self, "_draws", draws)
        object.__setattr__(self, "_salts", salts)

    # ---- to override -------------------------------------------------------------------------

    reads_key = True
    """Whether `apply` itself draws from its `key` (dropout). A layer that only hands its key to sub-layers
    through `call`, or never reads it, sets False: `call` then folds no key for it unless a sub-layer draws."""

    def validate(self) -> None:
        """Check hyperparameters; raise `ValueError` naming the field. Default: nothing to check."""

    def declare(self) -> Mapping[str, Union[Param, "Module"]]:
        """Name -> `Param` or sub-`Module`, in the order parameters appear in the tree."""
        return {}

    def apply(self, params: Params, *args: Any, key: Optional[Key] = None, **kwargs: Any) -> Any:
        """Compute the layer's output from `params` (a tree shaped like `init`'s result).

        Raises:
            NotImplementedError: `Module` itself computes nothing; subclasses define `apply`.
        """
        raise NotImplementedError(f"{type(self).__name__} must define apply(params, x, *, key=None, **kwargs).")

    # ---- structure ---------------------------------------------------------------------------

    @property
    def children(self) -> Dict[str, Union[Param, "Module"]]:
        """The cached `declare()` mapping (do not mutate)."""
        return self._children

    @property
    def has_params(self) -> bool:
        """True if this layer or any sub-layer declares a parameter."""
        return self._has_params

    @property
    def draws(self) -> bool:
        """True if this layer or any sub-layer reads its key (`reads_key`): only then does it get one."""
        return self._draws

    def param_specs(self) -> PyTree:
        """The tree of `Param` declarations, shaped like `init`'s result."""
        out = {}
        for name, child in self._children.items():
            if isinstance(child, Param):
                out[name] = child
            elif child.has_params:
                out[name] = child.param_specs()
        return out

    @property
    def axes(self) -> PyTree:
        """Logical axis names: the params tree with a tuple of names (or None) per parameter.

        Tuples are pytree nodes, so pair it with params by prefix (`tree_map(f, params, axes)`)
        or flatten it with `is_leaf=lambda x: isinstance(x, tuple)`.
        """
        return pytree.tree_map(lambda p: p.axes, self.param_specs())

    def param_shapes(self) -> PyTree:
        """Meta tensors with every parameter's shape and dtype; allocates nothing (for `--dry-run`)."""
        return pytree.tree_map(lambda p: p.abstract(), self.param_specs())

    # ---- init / apply plumbing ---------------------------------------------------------------

    def init(self, key: Key) -> Params:
        """Create every parameter; each one's key is `path_key(key, dotted_path)`.

        Args:
            key: an ember key; parameters land on its device (a key on "meta" gives meta tensors).

        Returns:
            A nested dict (lists under `Sequential`) of tensors.
        """
        return self.init_at(key, "")

    def init_at(self, key: Key, path: str) -> Params:
        """`init` for a layer living at dotted `path` inside a larger model (keys depend on it)."""
        out = {}
        for name, child in self._children.items():
            sub = _join(path, name)
            if isinstance(child, Param):
                out[name] = child.create(path_key(key, sub), path=sub)
            elif child.has_params:
                out[name] = child.init_at(key, sub)
        return out

    def gathered(self, params: Params) -> Params:
        """`params` with this layer's own parameters laid out as the active compute rules say.

        Under FSDP that is the per-layer all-gather of weights stored sharded; without an active
        sharding (`ember.core.partition_specs.use_sharding`) it is `params` itself. `call` does it
        for every sub-layer, so `apply` code never has to.
        """
        own = [(n, c.axes) for n, c in self._children.items() if isinstance(c, Param) and c.axes is not None]
        if not own:
            return params  # a container (e.g. Sequential's list): its sub-layers gather their own
        out = dict(params)
        for name, axes in own:
            if name in out:
                out[name] = constrain(out[name], axes)
        return out

    def call(
        self, name: str, params: Params, *args: Any, key: Optional[Key] = None, **kwargs: Any
    ) -> Any:
        """Apply the sub-layer `name` on `params[name]`, with a key folded by `name` (None for a sub-layer that
        never `draws`), forwarding kwargs."""
        child = self._children[name]
        sub_params = params[name] if child.has_params else {}
        if current_sharding() is not None and child.has_params:
            sub_params = child.gathered(sub_params)
        sub_key = None if key is None or not child.draws else random.fold_in(key, self._salts[name])
        return child.apply(sub_params, *args, key=sub_key, **kwargs)
