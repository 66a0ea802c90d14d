"""torch's pytree module: the tree format `torch.compile` and `torch.func` understand natively.

torch ships it only as the private `torch.utils._pytree` (WORKAROUNDS entry `pytree`); ember's
`core/pytree.py` builds everything on this one import.
"""

from torch.utils import _pytree as torch_pytree

__all__ = ["spec_children", "torch_pytree"]


def spec_children(spec: "torch_pytree.TreeSpec") -> list:
    """A TreeSpec's child specs (`children()` from torch 2.10 on; `children_specs` before, now deprecated)."""
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)
