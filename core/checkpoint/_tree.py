"""A state pytree as orbax items and back: leaf records, tied tensors, mismatch reports.

Private module of `ember.core.checkpoint`. A state is flattened with `torch.utils._pytree` key
paths; every tensor leaf becomes a numpy view nested under its path components (so the saved item
reads with plain orbax as nested dicts), leaves under `params` go to their own orbax item (model-only
restores read just that), a tensor that appears twice (tied weights) is stored once and recorded
as an alias, and JSON scalars stay in the metadata. Restoring rebuilds the leaves in the
template's flatten order and unflattens with the template's tree structure, which carries the
static fields (`TrainState.tx`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..pytree import keystr, tree_flatten_with_path
from ._arrays import dtype_name

__all__ = ["FlatState", "LeafSpec", "flatten_state", "item_of", "mismatches", "nest", "template_specs", "unnest"]

PARAMS_ITEM = "params"  # orbax item holding the leaves whose first path component is `params`
STATE_ITEM = "state"  # orbax item holding every other tensor leaf
_JSON_SCALARS = (bool, int, float, str)
_MAX_LISTED = 8


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """One saved tensor: its dotted path, shape, dtype name and CRC-32 of its bytes (or None)."""

    path: str
    shape: Tuple[int, ...]
    dtype: str
    crc32: Optional[int] = None

    def to_json(self) -> list:
        return [self.path, list(self.shape), self.dtype, self.crc32]

    @classmethod
    def from_json(cls, row: list) -> "LeafSpec":
        path, shape, dtype, crc = row
        return cls(path, tuple(int(s) for s in shape), dtype, None if crc is None else int(crc))

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        return f"{self.shape} {self.dtype}"


@dataclasses.dataclass
class FlatState:
    """A flattened state: tensors to save (one per distinct tensor), aliases, scalars, structure."""

    paths: List[str]
    keys: Dict[str, Tuple[str, ...]]
    tensors: Dict[str, torch.Tensor]
    aliases: Dict[str, str]
    python: Dict[str, Any]
    treedef: Any


def _components(key_path: Tuple[Any, ...]) -> Tuple[str, ...]:
    return tuple(keystr((k,)) for k in key_path)


def flatten_state(state: Any, *, what: str = "state") -> FlatState:
    """Flatten `state`, naming every leaf by its dotted path.

    Raises:
        TypeError: a leaf is neither a tensor nor a JSON scalar (names its path).
        ValueError: two leaves render to the same path (e.g. dict keys `1` and `"1"`).
    """
    leaves, treedef = tree_flatten_with_path(state)
    flat = FlatState([], {}, {}, {}, {}, treedef)
    seen_ids: Dict[int, str] = {}
    seen_paths: Dict[str, Tuple[Any, ...]] = {}
    for key_path, leaf in leaves:
        comps = _components(key_path)
        path = ".".join(comps)
        if path in seen_paths:
            raise ValueError(
                f"{what}: two leaves are both named {path!r} (key paths {seen_paths[path]!r} and "
                f"{key_path!r}); checkpoints name leaves by dotted path, so rename one of the keys."
            )
        seen_paths[path] = key_path
        flat.paths.append(path)
        flat.keys[path] = comps
        if isinstance(leaf, torch.Tensor):
            if id(leaf) in seen_ids:
                flat.aliases[path] = seen_ids[id(leaf)]
            else:
                seen_ids[id(leaf)] = path
                flat.tensors[path] = leaf
        elif leaf is None or isinstance(leaf, _JSON_SCALARS):
            flat.python[path] = leaf
        else:
            raise TypeError(
                f"{what}: leaf {path!r} is a {type(leaf).__name__}; a checkpoint holds tensors and JSON "
                f"scalars (bool, int, float, str). Make it a tensor, or a static field "
                f"(`ember.core.pytree.field(static=True)`) that comes from the template on restore."
            )
    return flat


def item_of(path: str) -> str:
    """The orbax item a leaf path is stored in."""
    return PARAMS_ITEM if path.split(".", 1)[0] == PARAMS_ITEM else STATE_ITEM


def nest(entries: Dict[str, Any], keys: Dict[str, Tuple[str, ...]]) -> Dict[str, Dict[str, Any]]:
    """`{item: nested dict}` of `entries` (path -> array) under their path components."""
    items: Dict[str, Dict[str, Any]] = {}
    for path, value in entries.items():
        node = items.setdefault(item_of(path), {})
        comps = keys[path]
        for c in comps[:-1]:
            node = node.setdefault(c, {})
        node[comps[-1]] = value
    return items


def unnest(item: Dict[str, Any], *, prefix: Tuple[str, ...] = ()) -> Dict[str, np.ndarray]:
    """`{dotted path: array}` of a nested dict restored by orbax."""
    out: Dict[str, np.ndarray] = {}
    for k, v in item.items():
        comps = prefix + (str(k),)
        if isinstance(v, dict):
            out.update(unnest(v, prefix=comps))
        else:
            out[".".join(comps)] = v
    return out


def template_specs(like: Any) -> Tuple[FlatState, Dict[str, Tuple[Tuple[int, ...], str]]]:
    """Flatten a restore template; `{path: (shape, dtype name)}` of its tensor leaves.

    Template leaves may live on any device, including `meta` (only shapes and dtypes are read).
    """
    flat = flatten_state(like, what="like")
    specs = {}
    for path in flat.paths:
        t = flat.tensors.get(path)
        if t is None and path in flat.aliases:
            t = flat.tensors[flat.aliases[path]]
        if t is not None:
            specs[path] = (tuple(t.shape), dtype_name(t.dtype))
    return flat, specs


def _listed(paths: List[str], describe: Callable[[str], str]) -> List[str]:
    rows = [f"  {p}: {describe(p)}" for p in paths[:_MAX_LISTED]]
    if len(paths) > _MAX_LISTED:
        rows.append(f"  ... and {len(paths) - _MAX_LISTED} more")
    return rows


def mismatches(
    saved: Dict[str, LeafSpec],
    saved_python: Dict[str, Any],
    saved_aliases: Dict[str, str],
    like: FlatState,
    like_specs: Dict[str, Tuple[Tuple[int, ...], str]],
) -> List[str]:
    """Lines describing every difference between a checkpoint's leaves and a template's (empty: none)."""

    def saved_spec(p: str) -> Optional[LeafSpec]:
        return saved.get(saved_aliases.get(p, p))

    saved_paths = set(saved) | set(saved_aliases) | set(saved_python)
    like_paths = set(like.paths)
    lines: List[str] = []
    missing = [p for p in like.paths if p not in saved_paths]
    extra = sorted(saved_paths - like_paths)
    changed = [
        p for p in like.paths
        if p in like_specs and saved_spec(p) is not None
        and (saved_spec(p).shape, saved_spec(p).dtype) != like_specs[p]
    ]
    kind = [p for p in like.paths if p in saved_paths and ((p in like_specs) != (saved_spec(p) is not None))]
    if changed:
        lines.append(f"{len(changed)} leaves differ in shape or dtype (checkpoint vs like):")
        lines += _listed(changed, lambda p: f"{saved_spec(p).describe()} vs {like_specs[p][0]} {like_specs[p][1]}")
    if missing:
        lines.append(f"{len(missing)} leaves of `like` are not in the checkpoint:")
        lines += _listed(missing, lambda p: "{} {}".format(*like_specs[p]) if p in like_specs else "scalar")
    if extra:
        lines.append(f"{len(extra)} leaves of the checkpoint are not in `like`:")
        lines += _listed(extra, lambda p: saved_spec(p).describe() if saved_spec(p) else "scalar")
    if kind:
        lines.append(f"{len(kind)} leaves are a tensor on one side and a Python scalar on the other:")
        lines += _listed(kind, lambda p: "tensor in the checkpoint" if saved_spec(p) else "scalar in the checkpoint")
    return lines
