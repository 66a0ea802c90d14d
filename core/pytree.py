"""Pytrees on `torch.utils._pytree`, the tree format `torch.compile` understands natively.

Public names: `dataclass`, `field`, `MaskedNode`, `tree_map`, `tree_map_with_path`, `tree_leaves`,
`tree_flatten`, `tree_unflatten`, `tree_structure`, `tree_flatten_with_path`, `tree_paths`,
`tree_leaves_with_path`, `keystr`, `is_pytree_node`, `check_same_structure`, `tree_reduce`, `tree_all`
(the last two as in `jax.tree_util`).

A `@ember.core.pytree.dataclass` is a frozen dataclass registered as a pytree node: tensor fields
are leaves (children), fields declared with `field(static=True)` travel in the tree's context and
are compared by value, so a compiled step specialises on them. Update with `.replace(**changes)`.

Example:
    >>> import torch
    >>> from ember.core import pytree
    >>> @pytree.dataclass
    ... class Point:
    ...     xy: torch.Tensor
    ...     name: str = pytree.field(static=True, default="p")
    >>> p = Point(torch.zeros(2))
    >>> pytree.tree_map(lambda t: t + 1, p).xy.tolist()
    [1.0, 1.0]
    >>> pytree.tree_paths({"blocks": [{"wq": torch.ones(1)}]})
    ['blocks.0.wq']
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Iterable, List, Optional, Tuple, TypeVar, Union

import torch

from .compat.pytree import torch_pytree as _pytree

from .types import PyTree

__all__ = [
    "MaskedNode",
    "TreeSpec",
    "check_same_structure",
    "dataclass",
    "field",
    "is_pytree_node",
    "keystr",
    "tree_all",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_is_leaf",
    "tree_leaves",
    "tree_leaves_with_path",
    "tree_map",
    "tree_map_with_path",
    "tree_paths",
    "tree_reduce",
    "tree_structure",
    "tree_unflatten",
]

T = TypeVar("T")

tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_structure = _pytree.tree_structure
tree_flatten_with_path = _pytree.tree_flatten_with_path
TreeSpec = _pytree.TreeSpec
tree_is_leaf = _pytree.tree_is_leaf


def field(*, static: bool = False, **kwargs: Any) -> Any:
    """A dataclass field; `static=True` keeps it out of the leaves (hyperparameters, callables).

    Static fields must be hashable and comparable by value: a compiled function re-specialises
    when one changes. A tensor in a static field warns, since it would be baked into the graph.
    """
    metadata = dict(kwargs.pop("metadata", None) or {})
    metadata["static"] = static
    return dataclasses.field(metadata=metadata, **kwargs)


def _split_fields(cls: type) -> Tuple[List[str], List[str]]:
    children, static = [], []
    for f in dataclasses.fields(cls):
        (static if f.metadata.get("static", False) else children).append(f.name)
    return children, static


def _replace(self: T, **changes: Any) -> T:
    """Return a copy with `changes` applied (the object itself is frozen)."""
    return dataclasses.replace(self, **changes)


def _make_post_init(user_post_init: Callable[[Any], None] | None) -> Callable[[Any], None]:
    if getattr(user_post_init, "_ember_checks_static", False):
        user_post_init = user_post_init._ember_user_post_init  # a parent's wrapper: unwrap once

    def __post_init__(self: Any) -> None:
        # Skipped while tracing: the check is for users building states, and dataclass field
        # metadata (a mappingproxy) is opaque to Dynamo.
        static_names = () if torch.compiler.is_compiling() else type(self)._ember_static_fields
        for name in static_names:
            if isinstance(getattr(self, name), torch.Tensor):
                warnings.warn(
                    f"{type(self).__name__}.{name} is a static field but holds a tensor; it will "
                    f"be baked into compiled graphs as a constant. Declare it without "
                    f"`static=True` to make it a leaf.",
                    stacklevel=3,
                )
        if user_post_init is not None:
            user_post_init(self)

    __post_init__._ember_checks_static = True
    __post_init__._ember_user_post_init = user_post_init
    return __post_init__


def dataclass(cls: type[T] | None = None, **kwargs: Any) -> Any:
    """Make `cls` a frozen dataclass registered as a pytree node (see module docstring).

    Subclasses of a registered dataclass must be decorated again to add their own fields.
    """

    def wrap(cls: type[T]) -> type[T]:
        kwargs.setdefault("frozen", True)
        user_post_init = cls.__dict__.get("__post_init__")
        # Installed before `dataclasses.dataclass` so the generated __init__ calls it.
        cls.__post_init__ = _make_post_init(user_post_init or getattr(cls, "__post_init__", None))
        cls = dataclasses.dataclass(cls, **kwargs)
        children, static = _split_fields(cls)
        cls._ember_static_fields = tuple(static)

        def flatten(obj: Any) -> Tuple[List[Any], Any]:
            static_values = tuple(getattr(obj, n) for n in static)
            return [getattr(obj, n) for n in children], static_values

        def flatten_with_keys(obj: Any) -> Tuple[List[Tuple[Any, Any]], Any]:
            leaves, context = flatten(obj)
            return [(_pytree.GetAttrKey(n), v) for n, v in zip(children, leaves)], context

        def unflatten(values: Iterable[Any], context: Any) -> Any:
            kw = dict(zip(children, values))
            kw.update(zip(static, context))
            return cls(**kw)

        _pytree.register_pytree_node(
            cls,
            flatten,
            unflatten,
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
            flatten_with_keys_fn=flatten_with_keys,
        )
        if not hasattr(cls, "replace"):
            cls.replace = _replace
        return cls

    return wrap if cls is None else wrap(cls)


def _key_to_str(k: Any) -> str:
    if isinstance(k, _pytree.SequenceKey):
        return str(k.idx)
    if isinstance(k, _pytree.MappingKey):
        return str(k.key)
    if isinstance(k, _pytree.GetAttrKey):
        return k.name
    return str(k)


def keystr(path: Union[str, Tuple[Any, ...]]) -> str:
    """Render a key path as a dotted string: `("blocks", 3, "attn", "wq") -> "blocks.3.attn.wq"`.

    `path` is a key tuple (what `tree_flatten_with_path` yields) or a dotted string (what
    `tree_map_with_path` and `tree_leaves_with_path` pass), which comes back as it is: JAX's habit
    `keystr(path)` gives the same dotted path for either.

    Example:
        >>> tree = {"ln": {"scale": 1.0}}
        >>> [keystr(p) for p, _ in tree_flatten_with_path(tree)[0]], [keystr(p) for p, _ in tree_leaves_with_path(tree)]
        (['ln.scale'], ['ln.scale'])
    """
    if isinstance(path, str):
        return path
    if not isinstance(path, (tuple, list)):
        raise TypeError(f"keystr expects a key path (a tuple of keys from tree_flatten_with_path) or a dotted path "
                        f"string, got {type(path).__name__} {path!r}.")
    return ".".join(_key_to_str(k) for k in path)


def tree_leaves_with_path(tree: PyTree) -> List[Tuple[str, Any]]:
    """`[(dotted_path, leaf), ...]` in flatten order."""
    leaves, _ = tree_flatten_with_path(tree)
    return [(keystr(path), leaf) for path, leaf in leaves]


def tree_paths(tree: PyTree) -> List[str]:
    """Dotted paths of every leaf, in flatten order (`"blocks.3.attn.wq"`)."""
    return [p for p, _ in tree_leaves_with_path(tree)]


def tree_map_with_path(fn: Callable[[str, Any], Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """`tree_map` whose function also receives the dotted path of each leaf as first argument."""
    leaves, spec = tree_flatten_with_path(tree)
    others = [spec.flatten_up_to(r) for r in rest]
    out = [fn(keystr(path), leaf, *(o[i] for o in others)) for i, (path, leaf) in enumerate(leaves)]
    return tree_unflatten(out, spec)


@dataclass
class MaskedNode:
    """A placeholder with no leaves, standing where a transformation does not see a parameter.

    `optim.masked` puts it in place of masked-out leaves, per-parameter state that only some
    parameters need (Adafactor's factored moments) uses it for the others, so every tree keeps the
    paths of the parameter tree. (None would not do: it is a leaf here.)
    """


class _NoInitializer:
    def __repr__(self) -> str:
        return "<no initializer>"


_NO_INITIALIZER: Any = _NoInitializer()


def _jax_leaves(tree: PyTree, is_leaf: Optional[Callable[[Any], bool]]) -> List[Any]:
    """The leaves JAX sees: torch's pytree keeps None as a leaf, JAX treats it as an empty subtree."""
    return [leaf for leaf in _pytree.tree_leaves(tree, is_leaf=is_leaf) if leaf is not None]


def tree_reduce(
    function: Callable[[T, Any], T],
    tree: PyTree,
    initializer: Any = _NO_INITIALIZER,
    is_leaf: Optional[Callable[[Any], bool]] = None,
) -> T:
    """`functools.reduce(function, leaves, initializer)` over the leaves (`jax.tree_util.tree_reduce`).

    None is an empty subtree, as in JAX. On tensor leaves, reduce with tensor ops (`torch.add`,
    `torch.maximum`) to stay traceable; a Python `max` or `and` would read the values (a host sync).

    Example:
        >>> tree_reduce(lambda acc, x: acc + x, {"a": 1, "b": [2, 3], "c": None}, 10)
        16
    """
    leaves = _jax_leaves(tree, is_leaf)
    if initializer is _NO_INITIALIZER:
        if not leaves:
            raise TypeError("tree_reduce of a tree with no leaves needs an initializer, e.g. tree_reduce(fn, tree, 0).")
        return functools.reduce(function, leaves)
    return functools.reduce(function, leaves, initializer)


def tree_all(tree: PyTree, *, is_leaf: Optional[Callable[[Any], bool]] = None) -> bool:
    """True if every leaf is truthy (`jax.tree_util.tree_all`); a tree with no leaves is True.

    Meant for trees of Python values (masks, flags). A tensor leaf is read with `bool()`, a host
    sync that only a one-element tensor allows; inside a step use tensor reductions instead
    (`ember.core.tree_math.tree_all_finite`, `torch.stack([...]).all()`).

    Example:
        >>> tree_all({"w": True, "b": [True, None]}), tree_all({"w": True, "b": False})
        (True, False)
    """
    return all(_jax_leaves(tree, is_leaf))


def is_pytree_node(obj: Any) -> bool:
    """True if `obj` is a container `torch.utils._pytree` knows (dict, list, registered class...)."""
    return not _pytree.tree_is_leaf(obj)


def check_same_structure(a: PyTree, b: PyTree, *, what: str = "trees", fix: str = "") -> None:
    """Raise `ValueError` naming the first differing path when `a` and `b` differ in structure."""
    sa, sb = tree_structure(a), tree_structure(b)
    if sa == sb:
        return
    pa, pb = set(tree_paths(a)), set(tree_paths(b))
    only_a, only_b = sorted(pa - pb)[:5], sorted(pb - pa)[:5]
    detail = (
        f"paths only in the first: {only_a}; only in the second: {only_b}"
        if (only_a or only_b)
        else f"same paths but different containers:\n  {sa}\nvs\n  {sb}"
    )
    raise ValueError(f"{what} do not have the same structure: {detail}. {fix}".rstrip())
