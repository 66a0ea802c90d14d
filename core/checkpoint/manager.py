"""`CheckpointManager`: save a training state every N steps and restore it bit for bit, on orbax.

Public names: `CheckpointManager`.

One step of a checkpoint is an orbax step folder `DIR/<step>` holding these items:

    params/  every tensor under the state's `params` (orbax PyTreeSave of nested dicts)
    state/   every other tensor: optimizer state (incl. hyperparameter tensors, counts), step, key
    meta/    JSON: step, metrics, run config, model family / arch / config, and every leaf's
             path, shape, dtype and CRC-32 (`CheckpointMeta`)
    data/    JSON: the data iterator's state (`TorchBatches.get_state()`), when given

Tensors go to orbax as numpy views of their memory (bf16 / float8 through `ml_dtypes`) and come
back with `torch.from_numpy` on the requested device, with the exact dtype. orbax commits a step
atomically (it writes `DIR/<step>.orbax-checkpoint-tmp` and renames it when complete), so a
process killed mid-save leaves the previous steps intact; the next manager removes the unfinished
folder (orbax's own `cleanup_tmp_directories`) and never touches a committed step except to prune
by `max_to_keep` / `keep_best`.

Meshes. In one process, `sharding=` gathers sharded leaves on save (`Lowering.gather`) and places
restored ones with `ember.core.partition_specs.shard` (full arrays are read, then placed: the XLA
backend, or a DTensor mesh of one process). When torch.distributed runs several processes, every
process builds the manager (it joins `jax.distributed` beside torch.distributed, see
`_distributed.py`) and calls `save` / `restore` together: each process writes only its own shards
of one global checkpoint, and a restore onto a DTensor mesh reads only the shards the process
holds. The checkpoint is one logical object either way: any mesh, or one device, restores it.

Example:
    >>> import tempfile, torch
    >>> from ember.core import TrainState
    >>> class Count:  # any GradientTransformation; ember.optim builds real ones
    ...     def init(self, params): return {"count": torch.zeros((), dtype=torch.int64)}
    ...     def update(self, grads, state, params=None): return grads, {"count": state["count"] + 1}
    >>> state = TrainState.create(params={"w": torch.arange(3.0)}, tx=Count())
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with CheckpointManager(d, save_every=10) as ckpt:
    ...         ckpt.save(10, state, metrics={"loss": 1.5}, data_state={"next_batch": 10})
    ...         ckpt.wait()
    ...         restored, data_state, meta = ckpt.restore(like=state)
    True
    >>> torch.equal(restored.params["w"], state.params["w"]), data_state, meta.step, meta.metrics
    (True, {'next_batch': 10}, 10, {'loss': 1.5})
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..pytree import tree_unflatten
from ._arrays import checksums, dtype_name, to_numpy
from ._distributed import Distributed, multiprocess_world, numpy_restore_args, restore_sharded
from ._layout import META_ITEM, check_root, describe_contents, disk_bytes, step_dir, temporary_dirs
from ._meta import CheckpointError, CheckpointMeta
from ._restore import build_leaves, check_fit, leaf_tensor
from ._tree import PARAMS_ITEM, STATE_ITEM, LeafSpec, flatten_state, item_of, nest, template_specs, unnest

__all__ = ["CheckpointManager"]

DATA_ITEM = "data"
Mode = Literal["min", "max"]
_MODES = ("min", "max")


def _parse_keep_best(keep_best: Union[None, str, Tuple[str, str]]) -> Optional[Tuple[str, Mode]]:
    if keep_best is None:
        return None
    if isinstance(keep_best, str):
        keep_best = (keep_best, "min")
    if not (isinstance(keep_best, tuple) and len(keep_best) == 2 and isinstance(keep_best[0], str)):
        raise TypeError(f"keep_best must be a metric name or (name, 'min' | 'max'), e.g. ('eval_loss', 'min'); got {keep_best!r}.")
    if keep_best[1] not in _MODES:
        raise ValueError(f"keep_best mode must be one of {_MODES}, got {keep_best[1]!r} (for metric {keep_best[0]!r}).")
    return keep_best  # type: ignore[return-value]


def _to_host(x: torch.Tensor, sharding: Any, path: str) -> torch.Tensor:
    if sharding is not None:
        return sharding.lowering.gather(x)
    if type(x).__name__ == "DTensor":
        raise TypeError(f"state leaf {path!r} is a DTensor; pass sharding=... so save() can gather it.")
    return x if x.device.type == "cpu" else x.detach().cpu()


@contextlib.contextmanager
def _quiet_absl(quiet: bool) -> Iterator[None]:
    logger = logging.getLogger("absl")
    old = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


class CheckpointManager:
    """Saves and restores training states in a directory of orbax step folders.

    Args:
        directory: the checkpoint root (created when saving; e.g. `OUT/checkpoints`).
        save_every: `save` writes only at multiples of this step (unless `force=True`).
        max_to_keep: keep the newest this many steps (None: all); pruning runs after a commit.
        keep_best: also keep the best step by a metric given to `save`: a name (lower is better)
            or `(name, "min" | "max")`. Saves whose metrics lack it are pruned by `max_to_keep`.
        async_save: `save` returns once the arrays are copied; writing continues in the background.
        checksums: store a CRC-32 per array and verify it on restore (orbax has none).
        compress: zstd-compress the arrays (orbax's default). Float32 training state shrinks by
            under 10%, while saving and restoring on a CPU get several times slower; off by
            default. Restoring reads either kind.
        read_only: never write or delete (listing, exporting, evaluating).

    Raises:
        CheckpointError: the directory is a file or a single step, is missing (read_only), or holds
            number-named folders that are not checkpoints.
        RuntimeError: several processes run, and jax already started without `jax.distributed`.

    With several torch.distributed processes, build the manager on every process (a collective:
    it joins jax.distributed, the coordinator on rank 0) and call `save` / `restore` on every
    process; such saves store no CRC-32 (no process holds whole arrays), and the JSON items (meta,
    data state) are rank 0's.
    """

    def __init__(
        self,
        directory: Union[str, pathlib.Path],
        *,
        save_every: int = 1,
        max_to_keep: Optional[int] = None,
        keep_best: Union[None, str, Tuple[str, Mode]] = None,
        async_save: bool = True,
        checksums: bool = True,
        compress: bool = False,
        read_only: bool = False,
    ) -> None:
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as policies

        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ValueError(f"save_every must be an int >= 1 (steps between checkpoints), got {save_every!r}.")
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be None (keep all) or an int >= 1, got {max_to_keep!r}.")
        self.directory = pathlib.Path(directory).expanduser().absolute()
        self.read_only = read_only
        self.checksums = checksums
        self.keep_best = _parse_keep_best(keep_best)
        check_root(self.directory, writing=not read_only)
        keep: List[Any] = [policies.LatestN(max_to_keep)]
        best_fn = None
        if self.keep_best is not None:
            name, mode = self.keep_best
            best_fn = lambda metrics: float(metrics[name])  # noqa: E731
            keep.append(policies.BestN(get_metric_fn=best_fn, reverse=mode == "min", n=1,
                                       keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=0 if read_only else save_every,
            save_decision_policy=policies.FixedIntervalPolicy(save_every),
            preservation_policy=policies.AnyPreservationPolicy(keep),
            best_fn=best_fn,
            best_mode=self.keep_best[1] if self.keep_best else "max",
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        self._ocp = ocp
        self._dist = Distributed() if multiprocess_world() else None  # joins jax.distributed: before orbax starts
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item in (PARAMS_ITEM, STATE_ITEM):  # one handler per item serves both its save and restore args
            handler = ocp.PyTreeCheckpointHandler(use_compression=compress)
            registry.add(item, ocp.args.PyTreeSave, handler)
            registry.add(item, ocp.args.PyTreeRestore, handler)
        with _quiet_absl(read_only):  # orbax warns on every read-only manager that it is read-only
            self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        # orbax removes unfinished saves in a background thread it joins at the first save; join it
        # now, so the directory holds committed steps only once the manager exists.
        getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="ember-ckpt")

    # ---- steps --------------------------------------------------------------------------------

    def all_steps(self) -> List[int]:
        """Saved steps, ascending (including one an async save is still writing)."""
        return list(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        """The newest saved step, or None when there is none."""
        return self._manager.latest_step()

    def best_step(self) -> Optional[int]:
        """The best step by `keep_best` (None without `keep_best` or without such metrics)."""
        return None if self.keep_best is None else self._manager.best_step()

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would write (a multiple of `save_every`, newer than the latest)."""
        return not self.read_only and self._manager.should_save(step)

    def _resolve_step(self, step: Optional[int]) -> int:
        self._manager.wait_until_finished()  # a step still being written must commit before it is read
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(self._no_checkpoint_message())
            return steps[-1]
        if step not in steps:
            have = ", ".join(map(str, steps)) if steps else "none"
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; saved steps: {have}. "
                f"Pass one of those, or step=None for the latest."
            )
        return step

    def _no_checkpoint_message(self) -> str:
        tmp = temporary_dirs(self.directory)
        unfinished = (f" Unfinished saves ({', '.join(tmp)}) never committed: the process stopped mid-save."
                      if tmp else "")
        return (f"{self.directory} holds no ember checkpoint (it contains {describe_contents(self.directory)})."
                f"{unfinished} Pass the directory a run saved into (OUT/checkpoints).")

    # ---- save ---------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_state: Optional[Mapping[str, Any]] = None,
        config: Any = None,
        model_info: Optional[Mapping[str, Any]] = None,
        metrics: Optional[Mapping[str, Any]] = None,
        force: bool = False,
        sharding: Any = None,
    ) -> bool:
        """Save `state` as step `step` if it is due (a multiple of `save_every`) or `force`.

        With `async_save` this returns once the arrays are copied to host memory: training may go
        on (and donate or overwrite the state) while the files are written; `wait()` blocks until
        the step is committed.

        Args:
            step: the training step (an int >= 0, newer than every saved step).
            state: a pytree of tensors (a `TrainState`); static fields are not saved.
            data_state: the data iterator's JSON state (`batches.get_state()`), restored with the step.
            config: the run config (a dataclass, stored via `to_dict`, or a dict).
            model_info: `ember.core.checkpoint.model_info(family, config, arch=...)`.
            metrics: `{name: number or 0-d tensor}` (one host sync each); `keep_best` ranks by them.
            force: save even if `step` is not a multiple of `save_every` (the last step of a run).
            sharding: the `Sharding` the state is placed with; leaves are gathered to full CPU tensors.
                Not needed with several processes: each DTensor saves its own shards as laid out.

        Returns:
            True if a save was started, False if the step was not due.

        Raises:
            CheckpointError: the step is already saved (nothing is overwritten), or read_only.
            TypeError: a leaf is neither a tensor nor a JSON scalar; data_state is not JSON.
        """
        if self.read_only:
            raise CheckpointError(f"this CheckpointManager of {self.directory} is read_only; open it with read_only=False to save.")
        if isinstance(step, torch.Tensor):
            step = int(step)  # host sync: once per save
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"save(step=...) must be an int >= 0, got {step!r}.")
        if step in self.all_steps():
            raise CheckpointError(f"step {step} is already saved in {self.directory}; nothing was overwritten. "
                                  f"Restore it, or save a newer step.")
        if not force and not self._manager.should_save(step):
            return False
        if data_state is not None:
            try:
                json.dumps(data_state)
            except TypeError as e:
                raise TypeError(f"save(data_state=...) must be JSON-serialisable (get_state() of the iterator): {e}") from e
        flat = flatten_state(state)
        if self._dist is not None:  # every process hands orbax its own shards of global arrays; no CRCs
            arrays = {p: self._dist.global_array(t) for p, t in flat.tensors.items()}
            crcs: List[Optional[int]] = [None] * len(arrays)
        else:
            arrays = {p: to_numpy(_to_host(t, sharding, p)) for p, t in flat.tensors.items()}
            crcs = checksums(list(arrays.values()), pool=self._pool) if self.checksums else [None] * len(arrays)
        leaves = [LeafSpec(p, tuple(a.shape), dtype_name(flat.tensors[p].dtype), c) for (p, a), c in zip(arrays.items(), crcs)]
        meta = CheckpointMeta.build(step=step, leaves=leaves, aliases=flat.aliases, python_leaves=flat.python,
                                    metrics=metrics, config=config, model=model_info,
                                    has_data_state=data_state is not None)
        stored = {p: a for p, a in arrays.items() if a.size}  # orbax refuses empty arrays: metadata alone restores them
        args = {name: self._ocp.args.PyTreeSave(tree) for name, tree in nest(stored, flat.keys).items()}
        args[META_ITEM] = self._ocp.args.JsonSave(meta.to_json())
        if data_state is not None:
            args[DATA_ITEM] = self._ocp.args.JsonSave(dict(data_state))
        best = None
        if self.keep_best is not None and self.keep_best[0] in meta.metrics:
            best = {self.keep_best[0]: meta.metrics[self.keep_best[0]]}
        self._manager.save(step, args=self._ocp.args.Composite(**args), metrics=best, force=True)
        return True

    def wait(self) -> None:
        """Block until every started save is committed (re-raises a failed background save)."""
        self._manager.wait_until_finished()

    # ---- restore ------------------------------------------------------------------------------

    def read_meta(self, step: Optional[int] = None) -> CheckpointMeta:
        """The `CheckpointMeta` of `step` (default: the latest), reading no arrays."""
        step = self._resolve_step(step)
        where = step_dir(self.directory, step)
        if not (where / META_ITEM).is_dir():
            raise CheckpointError(
                f"{where} is not an ember checkpoint step: it has no `{META_ITEM}` item (it contains "
                f"{describe_contents(where)}). Pass a directory written by ember's CheckpointManager."
            )
        raw = self._read_items(step, {META_ITEM: self._ocp.args.JsonRestore()})[META_ITEM]
        return CheckpointMeta.from_json(raw, where=str(where))

    def _read_items(self, step: int, args: Dict[str, Any], *, metadata: bool = False) -> Any:
        try:
            if metadata:  # orbax's array metadata of every item (shapes, dtypes, the saving devices)
                found = self._manager.item_metadata(step)
                unreadable = [k for k in args if found.get(k) is None]  # e.g. a kill mid-prune removed it
                if unreadable:
                    raise FileNotFoundError(f"no readable metadata for items {unreadable}")
                return found
            restored = self._manager.restore(step, args=self._ocp.args.Composite(**args))
        except Exception as e:  # tensorstore / orbax errors: missing, truncated, unreadable files
            older = [s for s in self.all_steps() if s < step]
            raise CheckpointError(
                f"could not read {sorted(args)} of step {step} in {step_dir(self.directory, step)}: "
                f"{type(e).__name__}: {str(e)[:500]}. The step is damaged; nothing was changed on disk. "
                f"Restore an earlier step ({', '.join(map(str, older)) or 'none saved'}) with step=N."
            ) from e
        return {k: restored[k] for k in args}

    def _read_arrays(self, step: int, meta: CheckpointMeta, items: Sequence[str]) -> Dict[str, Any]:
        stored = {item_of(leaf.path) for leaf in meta.leaves if leaf.size}  # items orbax wrote
        wanted = sorted(stored & set(items))
        metadata = self._read_items(step, dict.fromkeys(wanted), metadata=True) if wanted else {}
        args = {name: self._ocp.args.PyTreeRestore(restore_args=numpy_restore_args(metadata[name].tree))
                for name in items if name in stored}  # numpy: a multi-process save's devices need not exist here
        arrays: Dict[str, Any] = {}
        for tree in (self._read_items(step, args) if args else {}).values():
            arrays.update(unnest(tree))
        want = [leaf for leaf in meta.leaves if item_of(leaf.path) in items and leaf.size]
        missing = [leaf.path for leaf in want if leaf.path not in arrays]
        if missing:
            raise CheckpointError(f"step {step} in {self.directory} lacks arrays its metadata lists: {missing[:8]}; the step is damaged.")
        bad = []
        if any(leaf.crc32 is not None for leaf in want):
            got = checksums([arrays[leaf.path] for leaf in want], pool=self._pool)
            bad = [leaf.path for leaf, c in zip(want, got) if leaf.crc32 is not None and c != leaf.crc32]
        if bad:
            raise CheckpointError(
                f"step {step} in {step_dir(self.directory, step)} is corrupted: {len(bad)} arrays do not match "
                f"the CRC-32 saved with them ({', '.join(bad[:8])}{', ...' if len(bad) > 8 else ''}). "
                f"Nothing was changed on disk; restore an earlier step with step=N "
                f"(saved: {', '.join(map(str, self.all_steps()))})."
            )
        return arrays

    def restore(
        self,
        step: Optional[int] = None,
        *,
        like: Any,
        device: Any = None,
        sharding: Any = None,
        axes: Any = None,
        model_info: Optional[Mapping[str, Any]] = None,
    ) -> Tuple[Any, Optional[Dict[str, Any]], CheckpointMeta]:
        """Restore step `step` (default: the latest) into the structure of `like`.

        The template is checked against the saved metadata before any array is read; each array's
        CRC-32 is verified; tensors come back with their saved dtype, on `device`.

        Args:
            step: the step to restore; None for the latest.
            like: a state of the same structure (e.g. a fresh `TrainState.create(...)`, possibly on
                the `meta` device); static fields (`tx`) come from it, tensor values never do.
            device: where restored tensors go; default each template leaf's device (`meta`: CPU).
            sharding: place the restored state with `ember.core.partition_specs.shard(state,
                sharding, axes=axes)`. On a DTensor mesh of several processes each reads only its
                own shards (no CRC check: the whole arrays are never read); otherwise full tensors
                are read and verified, then placed.
            axes: the model's logical axes tree (`model.axes`), needed with `sharding`.
            model_info: the current model's `model_info(...)`: a different family is refused and
                differences are named when the shapes do not fit.

        Returns:
            `(state, data_state, meta)`: the restored state, the saved data-iterator state (None
            if none was saved) and the step's `CheckpointMeta`.

        Raises:
            CheckpointError: no such step (lists the saved ones), not an ember checkpoint, a
                template that does not fit (names each differing leaf and both models), or a
                damaged / corrupted array file.
        """
        step = self._resolve_step(step)
        meta = self.read_meta(step)
        like_flat, like_specs = template_specs(like)
        check_fit(meta, step_dir(self.directory, step), like_flat, like_specs, model_info)
        if sharding is not None and axes is None:
            raise TypeError("restore(sharding=...) also needs axes=model.axes to place the parameters.")
        if self._dist is not None and sharding is not None and hasattr(sharding.lowering, "device_mesh"):
            # DTensor mesh over several processes: each reads only its own shards
            state = restore_sharded(self._dist, lambda args: self._read_items(step, args), meta, like, like_flat,
                                    sharding, axes)
        else:
            items = sorted({item_of(leaf.path) for leaf in meta.leaves})
            arrays = self._read_arrays(step, meta, items)
            leaves = build_leaves(meta, arrays, like_flat, device, on_cpu=sharding is not None)
            state = tree_unflatten(leaves, like_flat.treedef)
            if sharding is not None:
                from ..partition_specs import shard

                state = shard(state, sharding, axes=axes)
        data_state = None
        if meta.has_data_state:
            data_state = self._read_items(step, {DATA_ITEM: self._ocp.args.JsonRestore()})[DATA_ITEM]
        return state, data_state, meta

    def restore_params(self, step: Optional[int] = None, *, like: Any = None, device: Any = "cpu",
                       model_info: Optional[Mapping[str, Any]] = None) -> Any:
        """Restore only the parameters of `step` (default: the latest): no optimizer state is read.

        Args:
            step: the step; None for the latest.
            like: a params tree to restore into (its leaves may be on the `meta` device); None
                returns a flat `{dotted path: tensor}` dict (what safetensors export wants).
            device: where the tensors go (default CPU).
            model_info: as in `restore`.

        Returns:
            The params tree (structure of `like`), or `{"wte.weight": tensor, ...}`.

        Raises:
            CheckpointError: as `restore`, or the checkpoint has no `params` subtree.
        """
        step = self._resolve_step(step)
        meta = self.read_meta(step)
        prefix = PARAMS_ITEM + "."
        if not any(leaf.path.startswith(prefix) for leaf in meta.leaves):
            raise CheckpointError(
                f"step {step} in {self.directory} has no `params` subtree (the saved state had no field or key "
                f"named 'params'); restore the whole state with restore(like=...)."
            )
        if like is None:
            arrays = self._read_arrays(step, meta, [PARAMS_ITEM])
            out = {}
            for leaf_path in [leaf.path for leaf in meta.leaves] + list(meta.aliases):
                if leaf_path.startswith(prefix):
                    source = meta.aliases.get(leaf_path, leaf_path)
                    out[leaf_path[len(prefix):]] = leaf_tensor(meta, arrays, source, device)
            return out
        like_flat, like_specs = template_specs({PARAMS_ITEM: like})
        check_fit(meta, step_dir(self.directory, step), like_flat, like_specs, model_info, prefix=prefix)
        arrays = self._read_arrays(step, meta, [PARAMS_ITEM])
        leaves = build_leaves(meta, arrays, like_flat, device, on_cpu=False)
        return tree_unflatten(leaves, like_flat.treedef)[PARAMS_ITEM]

    def read_data_state(self, step: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """The data-iterator state saved with `step` (default: the latest), or None."""
        step = self._resolve_step(step)
        if not self.read_meta(step).has_data_state:
            return None
        return self._read_items(step, {DATA_ITEM: self._ocp.args.JsonRestore()})[DATA_ITEM]

    def disk_bytes(self, step: int) -> int:
        """Bytes the committed `step` takes on disk."""
        return disk_bytes(step_dir(self.directory, self._resolve_step(step)))

    # ---- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for pending saves, then release orbax's threads (idempotent)."""
        if self._manager is not None:
            try:
                self._manager.wait_until_finished()
            finally:
                self._manager.close()
                self._manager = None  # type: ignore[assignment]
                self._pool.shutdown()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, steps={self.all_steps() if self._manager else 'closed'})"
