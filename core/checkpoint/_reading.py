"""The read side of `CheckpointManager`: metadata, arrays (CRC-checked), whole states, params only,
and `verify` (is a step intact?).

Private module of `ember.core.checkpoint`; `CheckpointManager` inherits `CheckpointReader`, which
uses the manager's orbax `_manager`, `directory`, `_dist`, `_pool`, `_resolve_step` and `all_steps`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..pytree import tree_unflatten
from ._arrays import checksums
from ._distributed import numpy_restore_args, restore_sharded
from ._layout import META_ITEM, describe_contents, step_dir
from ._meta import CheckpointError, CheckpointMeta
from ._restore import build_leaves, check_fit, leaf_tensor
from ._tree import PARAMS_ITEM, item_of, template_specs, unnest

DATA_ITEM = "data"


def _some(paths: Sequence[str], limit: int = 3) -> str:
    """`"a, b, c, ..."`: the first `limit` of `paths`."""
    return ", ".join(paths[:limit]) + (", ..." if len(paths) > limit else "")


def _brief(error: CheckpointError) -> str:
    """The first line of what made `error` (orbax's / tensorstore's error), cut to 120 characters."""
    cause = error.__cause__
    text = (f"{type(cause).__name__}: {cause}" if cause else str(error)).splitlines()[0]
    return text if len(text) <= 120 else text[:117] + "..."


class CheckpointReader:
    """Reading committed steps; mixed into `CheckpointManager`."""

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

    def _read_stored(self, step: int, meta: CheckpointMeta, items: Sequence[str]) -> Dict[str, Any]:
        """`{path: numpy array}` of every array orbax stored in `items` (raises when unreadable)."""
        stored = {item_of(leaf.path) for leaf in meta.leaves if leaf.size}  # items orbax wrote
        wanted = sorted(stored & set(items))
        metadata = self._read_items(step, dict.fromkeys(wanted), metadata=True) if wanted else {}
        args = {name: self._ocp.args.PyTreeRestore(restore_args=numpy_restore_args(metadata[name].tree))
                for name in wanted}  # numpy: a multi-process save's devices need not exist here
        arrays: Dict[str, Any] = {}
        for tree in (self._read_items(step, args) if args else {}).values():
            arrays.update(unnest(tree))
        return arrays

    def _damaged_leaves(self, meta: CheckpointMeta, items: Sequence[str], arrays: Dict[str, Any]) -> Tuple[List[str], List[str]]:
        """`(missing, bad)`: leaf paths of `items` that orbax did not return, or whose CRC-32 differs."""
        want = [leaf for leaf in meta.leaves if item_of(leaf.path) in items and leaf.size]
        missing = [leaf.path for leaf in want if leaf.path not in arrays]
        checked = [leaf for leaf in want if leaf.crc32 is not None and leaf.path in arrays]
        got = checksums([arrays[leaf.path] for leaf in checked], pool=self._pool) if checked else []
        return missing, [leaf.path for leaf, c in zip(checked, got) if c != leaf.crc32]

    def _read_arrays(self, step: int, meta: CheckpointMeta, items: Sequence[str]) -> Dict[str, Any]:
        arrays = self._read_stored(step, meta, items)
        missing, bad = self._damaged_leaves(meta, items, arrays)
        if missing:
            raise CheckpointError(f"step {step} in {self.directory} lacks arrays its metadata lists: {missing[:8]}; the step is damaged.")
        if bad:
            raise CheckpointError(
                f"step {step} in {step_dir(self.directory, step)} is corrupted: {len(bad)} arrays do not match "
                f"the CRC-32 saved with them ({_some(bad, 8)}). "
                f"Nothing was changed on disk; restore an earlier step with step=N "
                f"(saved: {', '.join(map(str, self.all_steps()))})."
            )
        return arrays

    def verify(self, step: Optional[int] = None) -> List[str]:
        """Read every item of `step` (default: the latest) and check each array against its CRC-32.

        Holds one item's arrays in memory at a time (params, then the rest). Steps saved without
        CRC-32s (`checksums=False`, several processes) are checked for readability only.

        Returns:
            What is wrong with the step, one short line per problem; empty when it is intact.

        Raises:
            CheckpointError: no such step (a damaged step is reported, never raised).
        """
        step = self._resolve_step(step)
        if not (step_dir(self.directory, step) / META_ITEM).is_dir():
            return [f"no `{META_ITEM}` item (pruned or written half-way)"]
        try:
            meta = self.read_meta(step)
            if meta.has_data_state:
                self._read_items(step, {DATA_ITEM: self._ocp.args.JsonRestore()})
        except CheckpointError as e:
            return [f"unreadable: {_brief(e)}"]
        problems = []
        for item in sorted({item_of(leaf.path) for leaf in meta.leaves}):
            n = sum(1 for leaf in meta.leaves if item_of(leaf.path) == item and leaf.size)
            try:
                missing, bad = self._damaged_leaves(meta, [item], self._read_stored(step, meta, [item]))
            except CheckpointError as e:
                problems.append(f"`{item}` unreadable: {_brief(e)}")
                continue
            if missing:
                problems.append(f"{len(missing)} of {n} arrays missing ({_some(missing)})")
            if bad:
                problems.append(f"CRC-32 mismatch in {len(bad)} of {n} arrays ({_some(bad)})")
        return problems

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
