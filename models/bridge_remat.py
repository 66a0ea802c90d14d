"""Remat for bridged torch modules: run chosen submodules (a model's blocks) through `ember.core.remat`.

Public names: `remat_submodules` (used by `TorchModel.apply`), `check_remat_rules`.

`from_torch(module, remat={r"model\\.layers\\.\\d+": "full"})` names submodules by a regex that
must match the whole dotted name, and a policy (`ember.core.remat_policies`). While `apply` runs,
each matched submodule's `forward` is replaced on the instance by one that calls the submodule
functionally on its own parameters, passed as explicit inputs to `remat` (so gradients reach them),
and is put back afterwards.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Dict, Iterator, List, Mapping, Tuple, Union

import torch

from ..core import pytree
from ..core.remat import remat
from ..core.remat_policies import RematPolicy, remat_policy

__all__ = ["check_remat_rules", "remat_submodules"]

RematRules = Mapping[str, Union[str, RematPolicy]]


def check_remat_rules(module: torch.nn.Module, rules: RematRules) -> List[Tuple[str, Any]]:
    """`[(submodule name, policy)]` for `rules` (regex -> policy; the first full match wins).

    Raises:
        ValueError: a rule matches no submodule (a few submodule names are listed), or an
            unknown policy name.
    """
    names = [n for n, _ in module.named_modules() if n]
    chosen: Dict[str, Any] = {}
    for pattern, policy in rules.items():
        checked = remat_policy(policy)
        hits = [n for n in names if re.fullmatch(pattern, n)]
        if not hits:
            sample = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
            raise ValueError(
                f"remat rule {pattern!r} matches no submodule of {type(module).__name__} (it must match a "
                f"whole dotted name; submodules: {sample}). Fix the regex, e.g. r'model\\.layers\\.\\d+'."
            )
        for n in hits:
            chosen.setdefault(n, checked)
    nested = [n for n in chosen if any(n != m and n.startswith(m + ".") for m in chosen)]
    return [(n, p) for n, p in chosen.items() if p is not None and n not in nested]


@contextlib.contextmanager
def remat_submodules(module: torch.nn.Module, targets: List[Tuple[str, Any]]) -> Iterator[None]:
    """Within the block, each `(name, policy)` submodule of `module` runs through `remat`."""
    patched = []
    try:
        for name, policy in targets:
            sub = module.get_submodule(name)
            sub.forward = _rematted_forward(name, sub, policy)
            patched.append(sub)
        yield
    finally:
        for sub in patched:
            del sub.forward  # the class's forward again


def _check_stateless(name: str, arguments: List[Tuple[Any, Any]]) -> None:
    """Refuse objects a block could update (a KV cache): the recomputation would update them again."""
    for arg, value in arguments:
        for leaf in pytree.tree_leaves(value):
            if not isinstance(leaf, (torch.Tensor, int, float, bool, str, type(None))):
                raise ValueError(
                    f"remat'd submodule {name!r} got a {type(leaf).__name__} as argument {arg!r}; the backward "
                    "pass runs the submodule again, so a stateful object (a KV cache) would be updated twice. "
                    "Call the model without it (Hugging Face: use_cache=False in the loss function)."
                )


def _rematted_forward(name: str, sub: torch.nn.Module, policy: Any) -> Any:
    def run(params: Dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        with _class_forward(sub):  # also run by the backward pass, after `remat_submodules` has ended
            return torch.func.functional_call(sub, params, args, kwargs, strict=False)

    block = remat(run, policy=policy)

    def forward(*args: Any, **kwargs: Any) -> Any:
        _check_stateless(name, [*enumerate(args), *kwargs.items()])
        # Inside the outer functional_call these are the step's parameters, not the module's own.
        return block(dict(sub.named_parameters()), *args, **kwargs)

    return forward


@contextlib.contextmanager
def _class_forward(sub: torch.nn.Module) -> Iterator[None]:
    patched = sub.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if patched is not None:
            sub.forward = patched
