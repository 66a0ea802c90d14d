"""Which leaves a function's results depend on, and what it does to each group of leaves.

Public name: `LeafDependencies`, a dispatch mode for a run on the trace's fake tensors.

`blockwise_update` runs an optimizer's update one block of layers at a time, which is right only
if the update treats each block alike and apart from the others. This mode checks that on one run
of the update over the whole tree: each input tensor is tagged with its group (a block's number,
`REST` for the leaves outside the blocks, None for what every leaf may read: step counts,
hyperparameters), every result takes the group of the tensors it was computed from, and an op that
mixes two groups (a sum over every leaf) is recorded as a failure. For each block the mode logs the
ops that touch it, naming its tensors by their order within the block: two blocks the update treats
alike have equal logs. A `torch._foreach_*` op counts as one op per list element.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import Tensor
from .compat.dispatch_mode import TorchDispatchMode

from .pytree import tree_flatten

__all__ = ["LeafDependencies", "REST"]

REST = -1
"""The group of every leaf outside the blocks."""


class LeafDependencies(TorchDispatchMode):
    """Tags results with the group of their inputs; see the module docstring.

    Attributes:
        mixed: the first op that mixed two groups (`"aten::stack.default"`), or None.
        logs: per block, the ops that touched it, as comparable tuples.
    """

    def __init__(self) -> None:
        super().__init__()
        self._groups: Dict[int, Optional[int]] = {}
        self._names: Dict[int, Any] = {}
        self._counts: Dict[int, int] = {}
        self._keep: List[Tensor] = []  # every tagged tensor stays alive, so no id is reused
        self.mixed: Optional[str] = None
        self.logs: Dict[int, List[Tuple[Any, ...]]] = {}

    def tag(self, tensor: Tensor, group: Optional[int]) -> None:
        """Put an input in `group`: a block's number (>= 0), `REST`, or None (shared by all)."""
        self._set(tensor, group)

    def group_of(self, tensor: Any) -> Optional[int]:
        """The group `tensor` was computed from (None for shared values and untagged constants)."""
        return self._groups.get(id(tensor)) if isinstance(tensor, Tensor) else None

    def _set(self, tensor: Tensor, group: Optional[int]) -> None:
        self._keep.append(tensor)
        self._groups[id(tensor)] = group
        if group is not None:
            self._names[id(tensor)] = ("own", self._counts.get(group, 0))
            self._counts[group] = self._counts.get(group, 0) + 1
        else:
            self._names[id(tensor)] = ("shared", len(self._keep))

    def _name(self, x: Any) -> Any:
        if isinstance(x, Tensor):
            return self._names.get(id(x), ("const", tuple(x.shape), x.dtype))
        return repr(x)

    def _record(self, op: str, inputs: Sequence[Any], outputs: Sequence[Tensor]) -> None:
        groups = {self.group_of(x) for x in inputs} - {None}
        if len(groups) > 1:
            self.mixed = self.mixed or op
            return
        group = groups.pop() if groups else None
        if group is not None and group >= 0:
            self.logs.setdefault(group, []).append((op, tuple(self._name(x) for x in inputs)))
        for out in outputs:
            self._set(out, group)

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.mixed is not None:
            return out
        op = func.name()
        in_place = op.split("::")[-1].split(".")[0].endswith("_")  # `add_`: its first argument is the result
        if op.startswith("aten::_foreach_") and args and isinstance(args[0], (list, tuple)):
            n = len(args[0])
            outs = list(args[0]) if in_place else list(out)
            for i in range(n):
                element = [a[i] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args]
                leaves = tree_flatten((element, kwargs))[0]
                self._record(op, leaves, [outs[i]] if i < len(outs) else [])
            return out
        results = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        if in_place and args and isinstance(args[0], Tensor):
            results.append(args[0])
        self._record(op, tree_flatten((args, kwargs))[0], results)
        return out
