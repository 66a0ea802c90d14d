"""`plan_update`: a train step's update and its application, one block of layers at a time.

Public name: `plan_update` (what `train_step` asks for its gradient norm and its update).

Inside ember's Inductor step the update of every parameter is part of the step's graph, and
Inductor's time grows with the number of leaves (at 12 `llama3_tiny` layers the per-leaf tail was
35 s of the step graph's 42 s, BENCHMARKS.md). A model's repeated blocks (a list of alike layers,
`Sequential`'s runs) have alike leaves. Where loops roll, each run of `MIN_BLOCKS` or more alike
blocks goes through one rolled loop (`run_loop`) whose body (the update, its application, the
non-finite skip, each leaf's squared update norm) is compiled once and called per block; with the
state donated it writes each block's parameters and state in place. The gradient norm's per-leaf
sums take a loop of their own. What lies outside the runs (embeddings, the final norm) and the
state every leaf shares (step counts, hyperparameters) go through the transformation in the step's
graph, as every leaf does eagerly, on torch_xla and with DTensors.

A block's view of each tree keeps the whole tree's structure, with `MaskedNode` (an empty subtree,
as `optim.masked` leaves) where other leaves are. That is right only for a transformation that
treats every block of a run alike and apart from the others, apart from the global norm of its
input (`clip_by_global_norm`), which the step computes once over every leaf (`given_global_norm`).
One run of the update over the whole tree on the trace's fake tensors checks both
(`LeafDependencies`); where it fails, the update runs whole.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..compat.pytree import torch_pytree
from ..compat.shared_subgraph import run_untraced
from ..jit_backends.donation import donated
from ..leaf_dependencies import REST, LeafDependencies
from ..pytree import MaskedNode, tree_flatten, tree_flatten_with_path, tree_leaves, tree_unflatten
from ..rolled_loop import Compiled, meta, rolling, run_loop
from ..tree_math import apply_updates, given_global_norm, global_norm, square_sum, tree_where

__all__ = ["MIN_BLOCKS", "plan_update"]

MIN_BLOCKS = 4
"""The fewest alike blocks in a row that get a loop of their own."""


class WholeUpdate:
    """The update of every leaf at once, in the step's graph (eagerly, on torch_xla, with DTensors)."""

    def norm(self, tree: Any) -> Tensor:
        return global_norm(tree)

    def apply(self, tx: Any, grads: Any, opt_state: Any, params: Any, ok: Optional[Tensor],
              after: Sequence[Tensor] = ()) -> Tuple[Any, Any, Tensor]:
        """`(new_params, new_opt_state, update_norm)`; with `ok` (a 0-d bool) False, the old params
        and state (the update's norm all the same). `after`: what must be computed before the update."""
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = apply_updates(params, updates)
        if ok is not None:
            new_params = tree_where(ok, new_params, params)
            new_opt_state = tree_where(ok, new_opt_state, opt_state)
        return new_params, new_opt_state, global_norm(updates)


def plan_update(tx: Any, grads: Any, opt_state: Any, params: Any) -> "WholeUpdate":
    """How a train step computes norms over `grads`-shaped trees and applies `tx`: one block at a time
    where loops roll, the blocks are alike and the check passes (module docstring); else whole."""
    if rolling((grads, opt_state, params)):
        plan = BlockwiseUpdate.make(tx, grads, opt_state, params)
        if plan is not None:
            return plan
    return WholeUpdate()


def _padded(leaves: Sequence[Any], spec: Any, keep: Sequence[int]) -> Any:
    """The tree of `spec` holding `leaves` at positions `keep` (in order) and `MaskedNode` elsewhere."""
    full: List[Any] = [MaskedNode()] * spec.num_leaves
    for i, leaf in zip(keep, leaves):
        full[i] = leaf
    return tree_unflatten(full, spec)


def _blocks(paths: List[Tuple[Any, ...]], leaves: List[Tensor]) -> List[List[List[int]]]:
    """Runs of `MIN_BLOCKS` or more alike consecutive elements of a list in the tree: per run, per
    block, the positions of its leaves. A block is a subtree under a tree's outermost list."""
    lists: Dict[Tuple[Any, ...], Dict[int, List[int]]] = {}
    for i, path in enumerate(paths):
        at = next((j for j, k in enumerate(path) if isinstance(k, torch_pytree.SequenceKey)), None)
        if at is not None:
            lists.setdefault(tuple(path[:at]), {}).setdefault(path[at].idx, []).append(i)
    runs = []
    for prefix, blocks in lists.items():
        def alike(members: List[int]) -> Tuple[Any, ...]:
            return tuple((paths[i][len(prefix) + 1:], meta(leaves[i])) for i in members)

        run: List[List[int]] = []
        for idx in sorted(blocks):
            if run and (idx - 1 not in blocks or alike(blocks[idx]) != alike(run[-1])):
                runs.append(run)
                run = []
            run.append(blocks[idx])
        runs.append(run)
    return [run for run in runs if len(run) >= MIN_BLOCKS]


class BlockwiseUpdate(WholeUpdate):
    """Where each leaf of params and state goes: the rest, a block of a run, or (state) shared."""

    def __init__(self, runs: List[List[List[int]]], mirrors: List[List[List[int]]], n_params: int,
                 n_state: int, shared: List[int]) -> None:
        self.runs, self.mirrors = runs, mirrors  # mirrors[r][b]: state positions of run r's block b
        in_runs = {i for run in runs for block in run for i in block}
        in_mirrors = {j for run in mirrors for block in run for j in block}
        self.rest_params = [i for i in range(n_params) if i not in in_runs]
        self.rest_state = [j for j in range(n_state) if j not in in_mirrors]  # shared ones included
        self.shared = shared
        self.uses_norm = False
        self.norms: List[Tuple[List[Tensor], Tensor]] = []  # norms computed, by their leaves

    @classmethod
    def make(cls, tx: Any, grads: Any, opt_state: Any, params: Any) -> Optional["BlockwiseUpdate"]:
        with_paths, _ = tree_flatten_with_path(params)
        paths = [tuple(p) for p, _ in with_paths]
        p_leaves = [leaf for _, leaf in with_paths]
        if not all(isinstance(t, Tensor) for t in p_leaves):
            return None
        runs = _blocks(paths, p_leaves)
        if not runs:
            return None
        position = {path: i for i, path in enumerate(paths)}
        state_paths = [tuple(p) for p, _ in tree_flatten_with_path(opt_state)[0]]
        owner = [next((position[sp[s:]] for s in range(len(sp)) if sp[s:] in position), None) for sp in state_paths]
        block_of = {i: (r, b) for r, run in enumerate(runs) for b, block in enumerate(run) for i in block}
        mirrors: List[List[List[int]]] = [[[] for _ in run] for run in runs]
        for j, i in enumerate(owner):
            if i in block_of:
                r, b = block_of[i]
                mirrors[r][b].append(j)
        for r, run in enumerate(runs):  # each block's state must mirror the first block's
            def layout(b: int) -> List[Tuple[Any, int]]:
                return [(state_paths[j][:-len(paths[owner[j]])], run[b].index(owner[j])) for j in mirrors[r][b]]
            if any(layout(b) != layout(0) for b in range(1, len(run))):
                return None
        shared = [j for j, i in enumerate(owner) if i is None]
        plan = cls(runs, mirrors, len(p_leaves), len(state_paths), shared)
        return plan if plan._check(tx, grads, opt_state, params, block_of) else None

    def _check(self, tx: Any, grads: Any, opt_state: Any, params: Any, block_of: Dict[int, Tuple[int, int]]) -> bool:
        """One run of the update over the whole tree, untraced: are the blocks of each run alike and apart?"""
        g_leaves, p_spec = tree_flatten(grads)
        p_leaves = tree_leaves(params)
        s_leaves, s_spec = tree_flatten(opt_state)
        if len(g_leaves) != len(p_leaves) or not all(isinstance(t, Tensor) for t in (*g_leaves, *s_leaves)):
            return False
        group: Dict[int, Optional[int]] = {}
        tagged: List[Tuple[Tensor, Optional[int]]] = []
        block_id = {rb: n for n, rb in enumerate(sorted(set(block_of.values())))}
        for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
            at = block_id[block_of[i]] if i in block_of else REST
            tagged += [(g, at), (p, at)]
        state_block = {j: block_id[(r, b)] for r, run in enumerate(self.mirrors) for b, block in enumerate(run)
                       for j in block}
        for j, s in enumerate(s_leaves):
            tagged.append((s, state_block.get(j, None if j in self.shared else REST)))
        for t, at in tagged:  # a tensor in two groups (tied weights) cannot be split
            if group.setdefault(id(t), at) != at:
                return False

        def run() -> Optional[Tuple[Any, Any, LeafDependencies, List[Tensor]]]:
            norm = torch.empty((), dtype=torch.float32, device=g_leaves[0].device)
            mode = LeafDependencies()
            for t, at in tagged:
                mode.tag(t, at)
            with given_global_norm(grads, norm) as uses, mode:
                updates, new_state = tx.update(grads, opt_state, params)
            return updates, new_state, mode, uses

        try:
            updates, new_state, mode, uses = run_untraced(run)
        except Exception:  # noqa: BLE001 - an update the check cannot run is run whole
            return False
        u_leaves, u_spec = tree_flatten(updates)
        n_leaves, n_spec = tree_flatten(new_state)
        if mode.mixed is not None or u_spec != p_spec or n_spec != s_spec:
            return False
        for out, before in (*zip(u_leaves, g_leaves), *zip(n_leaves, s_leaves)):  # shared stays shared
            if mode.group_of(out) not in (None, group[id(before)]):
                return False
        for r, run_ in enumerate(self.runs):
            logs = [mode.logs.get(block_id[(r, b)], []) for b in range(len(run_))]
            if any(log != logs[0] for log in logs[1:]):
                return False
        self.uses_norm = bool(uses)
        return True

    def norm(self, tree: Any) -> Tensor:
        """`global_norm(tree)` (a tree shaped like the params), each run's per-leaf sums in a loop."""
        leaves = tree_leaves(tree)
        for known, value in self.norms:
            if len(known) == len(leaves) and all(a is b for a, b in zip(known, leaves)):
                return value
        squares: Dict[int, Tensor] = {i: square_sum(leaves[i]) for i in self.rest_params}
        for r, run in enumerate(self.runs):
            def body(block: List[Tensor]) -> Tensor:
                return torch.stack([square_sum(t) for t in block])

            compiled = Compiled(body)
            n = len(run[0])
            squares[run[0][0]] = run_loop(
                f"ember.train_step.norm{r}", _per_block(compiled, len(run), n), [leaves[i] for block in run for i in block],
                [((len(run), n), (n, 1), torch.float32, leaves[run[0][0]].device)])[0]
        value = self._sum_in_order(squares).sqrt()
        self.norms.append((leaves, value))
        return value

    def _sum_in_order(self, squares: Dict[int, Tensor]) -> Tensor:
        """The sum of every leaf's squares in the order `global_norm` adds them (so the bits agree):
        `squares` holds each rest leaf's, and at each run's first leaf the run's `[blocks, leaves]` sums."""
        pieces, i, n = [], 0, len(self.rest_params) + sum(len(run) * len(run[0]) for run in self.runs)
        while i < n:
            piece = squares[i]
            pieces.append(piece.reshape(-1))
            i += piece.numel()
        return torch.cat(pieces).sum()

    def apply(self, tx: Any, grads: Any, opt_state: Any, params: Any, ok: Optional[Tensor],
              after: Sequence[Tensor] = ()) -> Tuple[Any, Any, Tensor]:
        g_leaves, p_spec = tree_flatten(grads)
        p_leaves = tree_leaves(params)
        s_leaves, s_spec = tree_flatten(opt_state)
        norm = self.norm(grads) if self.uses_norm else None
        new_p: Dict[int, Tensor] = dict(enumerate(p_leaves))  # a donated run's blocks are written in place
        new_s: Dict[int, Tensor] = dict(enumerate(s_leaves))
        squares: Dict[int, Tensor] = {}

        # the rest, and the shared state, in the step's graph
        rest_g = _padded([g_leaves[i] for i in self.rest_params], p_spec, self.rest_params)
        rest_p = _padded([p_leaves[i] for i in self.rest_params], p_spec, self.rest_params)
        rest_s = _padded([s_leaves[j] for j in self.rest_state], s_spec, self.rest_state)
        updates, state = _update(tx, rest_g, rest_s, rest_p, norm)
        applied = apply_updates(rest_p, updates)
        if ok is not None:
            applied, state = tree_where(ok, applied, rest_p), tree_where(ok, state, rest_s)
        for i, p, u in zip(self.rest_params, tree_leaves(applied), tree_leaves(updates)):
            new_p[i], squares[i] = p, square_sum(u)
        for j, s in zip(self.rest_state, tree_leaves(state)):
            new_s[j] = s

        for r, run in enumerate(self.runs):
            squares[run[0][0]] = self._update_blocks(r, tx, g_leaves, p_leaves, s_leaves, p_spec, s_spec, norm, ok,
                                                     after, new_p, new_s)
        return (tree_unflatten([new_p[i] for i in range(len(p_leaves))], p_spec),
                tree_unflatten([new_s[j] for j in range(len(s_leaves))], s_spec), self._sum_in_order(squares).sqrt())

    def _update_blocks(self, r: int, tx: Any, g_leaves: List[Tensor], p_leaves: List[Tensor], s_leaves: List[Tensor],
                       p_spec: Any, s_spec: Any, norm: Optional[Tensor], ok: Optional[Tensor],
                       after: Sequence[Tensor], new_p: Dict[int, Tensor], new_s: Dict[int, Tensor]) -> Tensor:
        """Update run `r`'s blocks through one rolled loop (in place where the state is donated, else
        into `new_p` / `new_s` by position); returns each leaf's squared update norm, `[blocks, leaves]`."""
        run, mirrors, shared = self.runs[r], self.mirrors[r], self.shared
        first, first_mirror = run[0], mirrors[0]
        state_at = sorted(first_mirror + shared)  # the body's state leaves, in the state's order

        def body(block: Tuple[List[Tensor], List[Tensor]], g: List[Tensor], more: List[Tensor]):
            p, m = block
            sh, more = more[:len(shared)], more[len(shared):]
            keep, given = (more[0] if ok is not None else None), (more[1 if ok is not None else 0] if norm is not None else None)
            by_position = {**dict(zip(first_mirror, m)), **dict(zip(shared, sh))}
            grads_ = _padded(g, p_spec, first)
            params_ = _padded(p, p_spec, first)
            state_ = _padded([by_position[j] for j in state_at], s_spec, state_at)
            updates, state = _update(tx, grads_, state_, params_, given)
            applied, new_state = tree_leaves(apply_updates(params_, updates)), tree_leaves(state)
            new_m = [new_state[state_at.index(j)] for j in first_mirror]
            if keep is not None:
                applied = [torch.where(keep, a, b) for a, b in zip(applied, p)]
                new_m = [torch.where(keep, a, b) for a, b in zip(new_m, m)]
            return (applied, new_m), torch.stack([square_sum(u) for u in tree_leaves(updates)])

        n_p, n_m = len(first), len(first_mirror)
        width = 2 * n_p + n_m
        per_block = [t for block, mirror in zip(run, mirrors) for t in (
            [p_leaves[i] for i in block] + [s_leaves[j] for j in mirror] + [g_leaves[i] for i in block])]
        more = [s_leaves[j] for j in shared] + [t for t in (ok, norm) if t is not None]
        # A donated state's blocks (each block's params and state: `owned`, positions in `per_block`)
        # are written in place; otherwise each block's new params and state are the loop's results.
        owned = [b * width + k for b in range(len(run)) for k in range(n_p + n_m)]
        in_place = donated([per_block[i] for i in owned])
        compiled = Compiled(body, donate="state" if in_place else "none")

        def loop(inputs: List[Tensor]) -> List[Tensor]:
            rest = inputs[len(run) * width:len(run) * width + len(more)]
            sums, new = [], []
            for b in range(len(run)):
                x = inputs[b * width:(b + 1) * width]
                (applied, new_m), squares = compiled((x[:n_p], x[n_p:n_p + n_m]), x[n_p + n_m:], rest)
                sums.append(squares)
                new += [] if in_place else [*applied, *new_m]
            return [torch.stack(sums), *new]

        # `after` (the loss, the metrics) are inputs only so that every read of the old parameters
        # is done before the loop overwrites them.
        out = [((len(run), n_p), (n_p, 1), torch.float32, p_leaves[first[0]].device)]
        if not in_place:
            out += [meta(per_block[i]) for i in owned]
        results = run_loop(f"ember.train_step.update{r}", loop, [*per_block, *more, *after], out,
                           writes=owned if in_place else [])
        if not in_place:
            for b, (block, mirror) in enumerate(zip(run, mirrors)):
                new = results[1 + b * (n_p + n_m):1 + (b + 1) * (n_p + n_m)]
                new_p.update(zip(block, new[:n_p]))
                new_s.update(zip(mirror, new[n_p:]))
        return results[0]


def _per_block(compiled: Callable, blocks: int, width: int) -> Callable[[List[Tensor]], List[Tensor]]:
    """A loop calling `compiled(block's tensors)` per block, its results stacked."""
    def loop(inputs: List[Tensor]) -> List[Tensor]:
        return [torch.stack([compiled(inputs[b * width:(b + 1) * width]) for b in range(blocks)])]
    return loop


def _update(tx: Any, grads: Any, state: Any, params: Any, norm: Optional[Tensor]) -> Tuple[Any, Any]:
    if norm is None:
        return tx.update(grads, state, params)
    with given_global_norm(grads, norm):
        return tx.update(grads, state, params)
