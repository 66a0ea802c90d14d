"""Remat policies: which intermediate results of a remat'd block are kept instead of recomputed.

Public names: `RematPolicy`, `checkpoint_name`, `remat_policy`, `save_names`, `POLICY_NAMES`, `NO_REMAT`.

`remat(block, policy=...)` (in `remat.py`) always keeps the block's inputs. A policy picks, op by
op, which other results to keep, like `jax.checkpoint_policies`:

- `"full"`: nothing else; the backward recomputes the whole block.
- `"dots_saveable"`: the outputs of matrix products (`mm`, `bmm`, `addmm`, fused attention,
  convolution); the backward recomputes only the cheap elementwise work between them.
- `"dots_with_no_batch_dims_saveable"`: only the weight matmuls (`mm`, `addmm`); attention's
  batched products are recomputed too.
- `save_names("qkv", ...)` (on the command line `"save:qkv,mlp_hidden"`): the tensors the block
  tagged with `checkpoint_name(x, "qkv")`.
- `"everything_saveable"`: nothing is recomputed. It keeps every result but reshapes and 0-d results,
  which cost nothing to recompute (random keys' bit arithmetic, scalars); in a traced rolled layer
  (`remat_scan`) only those the backward reads, as a plain block's autograd graph holds them
  (`Record`).
- `"none"` turns remat off (the block runs as written). A rolled stack of layers still records what the
  backward reads, with `NO_REMAT`: what autograd saves but elementwise results, rebuilt in the backward
  from the results they come from (what torch.compile's partitioner keeps).

How it works: while the block's forward runs, a dispatch mode records the outputs the policy keeps
(each by its op and occurrence, the 3rd `aten.mm` of the block say). While the backward recomputes
the block, a second mode hands those outputs back instead of running the op again, so the op's
own inputs need not be recomputed either when nothing else uses them (the traced graph drops
them as dead code). The block must call the same ops in the same order each time (a pure block
does).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import torch
from .compat.dispatch_mode import TorchDispatchMode

__all__ = ["NO_REMAT", "POLICY_NAMES", "RematPolicy", "checkpoint_name", "remat_policy", "save_names"]

_BATCHED_DOTS = ("bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "convolution")
_WEIGHT_DOTS = ("mm", "addmm")
# Reshapes whose schema does not say they alias: Inductor returns a view of their input, so keeping
# one keeps its input twice (and a `scan` node, whose body may not return one buffer twice, copies it).
_FREE = ("_unsafe_view", "view_copy", "_reshape_copy")


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """What a remat'd block keeps besides its inputs: ops whose outputs are saved, and tagged names.

    Attributes:
        name: how the policy is written on the command line (`"full"`, `"save:qkv"`).
        ops: `aten` op packets (`"mm"`, `"bmm"`, ...) whose outputs are kept.
        names: `checkpoint_name` tags whose tensors are kept.
    """

    name: str
    ops: FrozenSet[str] = frozenset()
    names: FrozenSet[str] = frozenset()
    everything: bool = False
    elementwise: bool = True  # with `everything`: elementwise results kept too (else rebuilt from their inputs)

    @property
    def saves_anything(self) -> bool:
        return bool(self.ops or self.names or self.everything)

    def saves_op(self, func: Any, out: Any) -> bool:
        if self.everything:  # but what costs nothing to recompute: a reshape, a 0-d result
            if not self.elementwise and torch.Tag.pointwise in getattr(func, "tags", ()):
                return False
            return _packet_name(func) not in _FREE and not (isinstance(out, torch.Tensor) and out.dim() == 0)
        return _packet_name(func) in self.ops


def save_names(*names: str) -> RematPolicy:
    """Keep the tensors tagged `checkpoint_name(x, name)` for any of `names`; recompute the rest."""
    if not names or not all(isinstance(n, str) and n and "," not in n for n in names):
        raise ValueError(
            f"save_names(...) takes one or more non-empty tag names without commas, got {names!r}; "
            "e.g. save_names('qkv', 'mlp_hidden')."
        )
    return RematPolicy("save:" + ",".join(names), names=frozenset(names))


_NAMED = {
    "full": RematPolicy("full"),
    "dots_saveable": RematPolicy("dots_saveable", ops=frozenset(_WEIGHT_DOTS + _BATCHED_DOTS)),
    "dots_with_no_batch_dims_saveable": RematPolicy(
        "dots_with_no_batch_dims_saveable", ops=frozenset(_WEIGHT_DOTS)
    ),
    "everything_saveable": RematPolicy("everything_saveable", everything=True),
}
NO_REMAT = RematPolicy("none", everything=True, elementwise=False)
"""What a rolled layer keeps without remat: what autograd saves, its elementwise results rebuilt in the backward
from the results they are computed from, as torch.compile's partitioner rebuilds them (nothing else recomputed)."""
POLICY_NAMES: Tuple[str, ...] = ("none", *_NAMED, "save:<name>,...")
"""Every policy name `remat_policy` accepts (`save:` takes the `checkpoint_name` tags to keep)."""


def remat_policy(policy: Union[str, RematPolicy, bool, None]) -> Optional[RematPolicy]:
    """The policy for a name (`"none"`, `"full"`, `"dots_saveable"`, `"save:a,b"`), or None for none.

    `True` / `False` are read as `"full"` / `"none"` (configs saved before policies had names).

    Raises:
        ValueError: an unknown name (the nearest known names are listed).
        TypeError: neither a string, a bool nor a `RematPolicy`.
    """
    if isinstance(policy, RematPolicy):
        return policy
    if isinstance(policy, bool) or policy is None:
        return _NAMED["full"] if policy else None
    if not isinstance(policy, str):
        raise TypeError(
            f"a remat policy is a name such as 'full' or a RematPolicy, got {type(policy).__name__} {policy!r}."
        )
    if policy == "none":
        return None
    if policy in _NAMED:
        return _NAMED[policy]
    if policy.startswith("save:"):
        return save_names(*[n.strip() for n in policy[len("save:"):].split(",") if n.strip()])
    known = [*_NAMED, "none", "save:"]
    nearest = difflib.get_close_matches(policy, known, n=3, cutoff=0.5)
    nearest += [n for n in known if policy and n.startswith(policy) and n not in nearest]  # abbreviations
    hint = f"did you mean {' or '.join(repr(n) for n in nearest)}? " if nearest else ""
    raise ValueError(
        f"unknown remat policy {policy!r}; {hint}known: {', '.join(POLICY_NAMES)} "
        "(save:<names> keeps the tensors a model tags with checkpoint_name)."
    )


def _packet_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", None)
    return getattr(packet, "__name__", "") if packet is not None else ""


def _aliases_or_mutates(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is None or schema.is_mutable or any(r.alias_info is not None for r in schema.returns)


def _tensors_in(values: Sequence[Any]) -> List[torch.Tensor]:
    """The tensors among an op's arguments, also inside lists (`aten.cat`'s, `aten.index`'s)."""
    found: List[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found.extend(t for t in v if isinstance(t, torch.Tensor))
    return found


def _occurrence(seen: Dict[Any, int], func: Any) -> Tuple[Any, int]:
    """`(func, n)` for the n-th call of `func` (from 0) counted in `seen`: how Record and Replay name an output."""
    n = seen.get(func, 0)
    seen[func] = n + 1
    return func, n


_RECORDERS: List["Record"] = []  # the remat forwards being traced or run, innermost last


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Tag `x` as `name` for `save_names` policies; returns `x` itself (`jax.ad_checkpoint.checkpoint_name`).

    Outside a remat'd block, or under a policy that does not keep `name`, it does nothing.
    """
    if _RECORDERS:
        _RECORDERS[-1].keep_named(x, name)
    return x


class Record(TorchDispatchMode):
    """While a block's forward runs: keep the outputs `policy` selects, keyed by (op, occurrence).

    With `only_what_autograd_saves` (a block run differentiated, whose backward is traced so that
    unused recomputation is dead code), `everything_saveable` keeps only what the backward reads:
    the results autograd saves, or the nearest results they are rebuilt from for free (a reshape's
    input, a view's base), as a plain block's autograd graph would hold them.
    """

    def __init__(self, policy: RematPolicy, only_what_autograd_saves: bool = False) -> None:
        super().__init__()
        self.policy = policy
        self.saved: Dict[Tuple[Any, int], Any] = {}
        self._seen: Dict[Any, int] = {}
        self._producer: Dict[int, Tuple[Tuple[Any, int], Any, Any]] = {}
        self._pruning = only_what_autograd_saves and policy.everything and torch.is_grad_enabled()
        # per result: its key if it may be kept, the op's outputs (alive: ids stay unique), its inputs' ids
        self._made: Dict[int, Tuple[Optional[Tuple[Any, int]], Any, List[int]]] = {}
        self._read: Dict[int, torch.Tensor] = {}  # what autograd saved (kept alive: ids stay unique)
        self._hooks: Any = None

    def __enter__(self) -> "Record":
        _RECORDERS.append(self)
        if self._pruning:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _RECORDERS.remove(self)
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
            self.saved = self._what_the_backward_reads()
        self._producer.clear()
        self._made.clear()
        self._read.clear()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple = (), kwargs: Optional[Dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        key = _occurrence(self._seen, func)
        aliases = _aliases_or_mutates(func)
        keeps = not aliases and self.policy.saves_op(func, out)
        if self._pruning:
            made_from = [id(t) for t in _tensors_in((*args, *(kwargs or {}).values()))]
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self._made[id(t)] = (key if keeps else None, out, made_from)
        if aliases:
            return out  # a view or an in-place result cannot be handed back in place of the op
        if keeps:
            self.saved[key] = out
        elif self.policy.names:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):  # t stays alive with the entry, so its id is not reused
                    self._producer[id(t)] = (key, out, t)
        return out

    def keep_named(self, x: torch.Tensor, name: str) -> None:
        entry = self._producer.get(id(x))
        if name in self.policy.names and entry is not None and entry[2] is x:
            self.saved[entry[0]] = entry[1]

    def _pack(self, saved: torch.Tensor) -> torch.Tensor:
        t: Optional[torch.Tensor] = saved
        while t is not None:
            self._read[id(t)] = t
            t = t._base
        return saved

    def _what_the_backward_reads(self) -> Dict[Tuple[Any, int], Any]:
        """The recorded results autograd saved, each traced back through free ops to one kept result."""
        kept, todo, visited = set(), list(self._read), set()
        while todo:
            tid = todo.pop()
            if tid in visited or tid not in self._made:  # seen, or an input of the block
                continue
            visited.add(tid)
            key, _, made_from = self._made[tid]
            if key is not None:
                kept.add(key)
            else:
                todo.extend(made_from)
        return {key: out for key, out in self.saved.items() if key in kept}  # in the forward's order


class Replay(TorchDispatchMode):
    """While the backward recomputes the block: hand back what `Record` kept instead of running the op."""

    def __init__(self, saved: Dict[Tuple[Any, int], Any]) -> None:
        super().__init__()
        self.saved = saved
        self._seen: Dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple = (), kwargs: Optional[Dict] = None) -> Any:
        key = _occurrence(self._seen, func)
        if key in self.saved:
            return self.saved[key]
        return func(*args, **(kwargs or {}))


def flatten_saved(saved: Dict[Tuple[Any, int], Any]) -> Tuple[List[Tuple[Any, int]], List[Any], List[torch.Tensor]]:
    """`(keys, structures, tensors)`: the kept outputs as a flat tensor list and how to rebuild them."""
    keys, structures, tensors = [], [], []
    for key, out in saved.items():
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        keys.append(key)
        structures.append((type(out) if isinstance(out, (tuple, list)) else None,
                           [isinstance(t, torch.Tensor) for t in outs], [None if isinstance(t, torch.Tensor) else t for t in outs]))
        tensors.extend(t for t in outs if isinstance(t, torch.Tensor))
    return keys, structures, tensors


def unflatten_saved(keys: List[Tuple[Any, int]], structures: List[Any], tensors: Any) -> Dict[Tuple[Any, int], Any]:
    """The inverse of `flatten_saved`, on the tensors as the backward sees them."""
    it = iter(tensors)
    saved: Dict[Tuple[Any, int], Any] = {}
    for key, (container, is_tensor, consts) in zip(keys, structures):
        outs = [next(it) if t else c for t, c in zip(is_tensor, consts)]
        saved[key] = container(outs) if container is not None else outs[0]
    return saved
