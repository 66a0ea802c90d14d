"""Restoring into a template: the fit check before reading, and the leaves built after.

Private module of `ember.core.checkpoint`. `check_fit` compares the saved leaf records with the
template (`like`) and raises one error naming every differing leaf and both models; `build_leaves`
turns the arrays orbax read into tensors in the template's flatten order, sharing tied tensors and
taking JSON-scalar leaves from the metadata.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from ._arrays import from_numpy
from ._meta import CheckpointError, CheckpointMeta, describe_model, model_diff
from ._tree import FlatState, mismatches

__all__ = ["assemble_leaves", "build_leaves", "check_fit", "leaf_tensor"]


def check_fit(
    meta: CheckpointMeta,
    where: pathlib.Path,
    like: FlatState,
    like_specs: Dict[str, Any],
    model_info: Optional[Mapping[str, Any]],
    *,
    prefix: str = "",
) -> None:
    """Raise `CheckpointError` if the saved leaves under `prefix` differ from the template's, or
    the model family differs; the message lists each difference and both model descriptions."""
    keep = lambda p: p.startswith(prefix)  # noqa: E731
    saved = {leaf.path: leaf for leaf in meta.leaves if keep(leaf.path)}
    lines = mismatches(saved, {p: v for p, v in meta.python_leaves.items() if keep(p)},
                       {p: v for p, v in meta.aliases.items() if keep(p)}, like, like_specs)
    diff = model_diff(meta.model, model_info)
    if not lines and not any(line.startswith("family:") for line in diff):
        return
    msg = [f"checkpoint step {meta.step} in {where} does not fit the state it is restored into (`like`).", *lines,
           f"checkpoint model: {describe_model(meta.model)}"]
    if model_info:
        msg.append(f"your model: {describe_model(model_info)}")
    if diff:
        msg.append("model differences: " + "; ".join(diff))
    saved_paths = set(saved) | {p for p in (*meta.python_leaves, *meta.aliases) if keep(p)}
    differing = saved_paths ^ set(like.paths)
    if differing and all(p.startswith("opt_state.") for p in differing) and not diff:
        msg.append("Fix: the optimizer differs from the checkpoint's (its transformations, or which parameters are in "
                   "which group, changed): build it as the checkpoint was saved, or restore the parameters alone "
                   "(restore_params) and start the new optimizer's state fresh. Nothing was read or changed.")
    else:
        msg.append("Fix: build `like` from the checkpoint's model config (CheckpointMeta.model / .config), "
                   "or point at the checkpoint directory of this model. Nothing was read or changed.")
    raise CheckpointError("\n".join(msg))


def leaf_tensor(meta: CheckpointMeta, arrays: Dict[str, Any], path: str, device: Any) -> torch.Tensor:
    """The restored tensor of saved leaf `path` (empty tensors are not stored: built from metadata)."""
    if path in arrays:
        return from_numpy(arrays[path], device=device)
    spec = next(leaf for leaf in meta.leaves if leaf.path == path)
    return torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)


def _device_for(like: FlatState, path: str, device: Any, on_cpu: bool) -> Any:
    if on_cpu:
        return "cpu"
    if device is not None:
        return device
    t = like.tensors.get(like.aliases.get(path, path))
    if t is None or t.device.type == "meta":
        return "cpu"
    if type(t).__name__ == "DTensor":
        raise TypeError(f"`like` leaf {path!r} is a DTensor; pass sharding=... and axes=... to place the restored state.")
    return t.device


def assemble_leaves(meta: CheckpointMeta, like: FlatState, make: Callable[[str, str], Any]) -> List[Any]:
    """The restored leaves in `like`'s flatten order, ready for `tree_unflatten(leaves, like.treedef)`.

    Python scalars come from the metadata; every stored tensor is built once by `make(path, source)`
    (`source`: the path it was saved under, so tied leaves stay one tensor).
    """
    tensors: Dict[str, Any] = {}
    out = []
    for path in like.paths:
        if path in meta.python_leaves:
            out.append(meta.python_leaves[path])
            continue
        source = meta.aliases.get(path, path)
        if source not in tensors:
            tensors[source] = make(path, source)
        out.append(tensors[source])
    return out


def build_leaves(meta: CheckpointMeta, arrays: Dict[str, Any], like: FlatState, device: Any, *, on_cpu: bool) -> List[Any]:
    """`assemble_leaves` from full arrays read by orbax.

    Args:
        meta: the step's metadata (aliases, scalar leaves, shapes of empty tensors).
        arrays: `{path: numpy array}` read by orbax.
        like: the flattened template.
        device: target device; None: each template leaf's device (`meta` leaves: CPU).
        on_cpu: force the CPU (a sharding places the tensors afterwards).
    """
    return assemble_leaves(
        meta, like, lambda path, source: leaf_tensor(meta, arrays, source, _device_for(like, path, device, on_cpu))
    )
