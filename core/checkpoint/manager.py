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
process killed mid-save leaves the previous steps intact; the next writing manager removes the
unfinished folder (orbax's own `cleanup_tmp_directories`, logged as a warning naming it; a read-only
manager leaves it) and never touches a committed step except to prune by `max_to_keep` / `keep_best`.

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
from typing import Any, Iterator, List, Literal, Mapping, Optional, Tuple, Union

import torch

from ._arrays import checksums, dtype_name, to_numpy
from ._distributed import Distributed, multiprocess_world
from ._jax_platform import keep_jax_on_cpu
from ._layout import META_ITEM, check_root, describe_contents, disk_bytes, step_dir, temporary_dirs
from ._meta import CheckpointError, CheckpointMeta
from ._reading import DATA_ITEM, CheckpointReader
from ._tree import PARAMS_ITEM, STATE_ITEM, LeafSpec, flatten_state, nest

__all__ = ["CheckpointManager"]

_log = logging.getLogger(__name__)
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


class CheckpointManager(CheckpointReader):
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
        keep_jax_on_cpu()  # before orbax imports JAX: JAX must not take the accelerator
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as policies

        from ..compat.orbax_loop import drain_orbax_loops

        drain_orbax_loops()  # a failed read leaves no read pending on a closed loop (its tracebacks)

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
        unfinished = [] if read_only else temporary_dirs(self.directory)
        if unfinished:
            _log.warning("%s: removing %d unfinished save(s) (%s): a process stopped mid-save; the committed steps "
                         "are untouched.", self.directory, len(unfinished), ", ".join(unfinished))
        self._dist = Distributed() if multiprocess_world() else None  # joins jax.distributed: before orbax starts
        # One handler per item serves both its save and restore args. Every item is registered up
        # front: orbax warns about each saved item it has no handler for whenever it reads a step's
        # metadata (twice per restore for `data`, which it otherwise meets only when it is read).
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item in (PARAMS_ITEM, STATE_ITEM):
            handler = ocp.PyTreeCheckpointHandler(use_compression=compress)
            registry.add(item, ocp.args.PyTreeSave, handler)
            registry.add(item, ocp.args.PyTreeRestore, handler)
        for item in (META_ITEM, DATA_ITEM):
            handler = ocp.JsonCheckpointHandler()
            registry.add(item, ocp.args.JsonSave, handler)
            registry.add(item, ocp.args.JsonRestore, handler)
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
        unfinished = (f" Unfinished saves ({', '.join(tmp)}) never committed: the process stopped mid-save, so "
                      f"they are no checkpoint (a writing run removes them; deleting them is safe)." if tmp else "")
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
