"""Several processes, one checkpoint: jax.distributed beside torch.distributed, DTensor shards as jax.Arrays.

Private module of `ember.core.checkpoint`. orbax writes a multi-process checkpoint when jax
knows the processes: `jax.distributed.initialize` (on CPU, one jax device per process, process id
= torch rank) joins them, after which a `jax.Array` can span devices of every process. Each
process describes its local DTensor shard to jax with the DTensor's own layout
(`NamedSharding` over a jax `Mesh` with the same axis names and the same rank order as the
`DeviceMesh`, the `PartitionSpec` read back from the placements) and orbax writes the shards the
process owns (replica 0 of each), into one global checkpoint.

Restoring onto a DTensor mesh asks orbax for the target layout (`ArrayRestoreArgs(sharding=...)`),
so each process reads only its own shards, and wraps them with `DTensor.from_local`. A
dimension that does not split evenly (DTensor's `torch.chunk` shards; jax needs equal shards) is
saved whole and placed after a full read instead.

The coordinator runs on rank 0: its address is `EMBER_JAX_COORDINATOR` (`host:port`) when set,
else `MASTER_ADDR` (default 127.0.0.1) and a free port rank 0 picks, broadcast over the default
process group.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..local_shards import is_dtensor
from ._arrays import from_numpy, to_numpy
from ._jax_platform import keep_jax_on_cpu

__all__ = ["Distributed", "multiprocess_world", "numpy_restore_args", "restore_sharded"]

_COORDINATOR_ENV = "EMBER_JAX_COORDINATOR"


def multiprocess_world() -> int:
    """The torch.distributed world size when more than one process runs, else 0."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_world_size()
    return 0


def _coordinator_address() -> str:
    """`host:port` of the jax coordinator, agreed by every rank (a collective)."""
    given = os.environ.get(_COORDINATOR_ENV)
    if given:
        return given
    box: List[Optional[str]] = [None]
    if dist.get_rank() == 0:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:
            s.bind(("", 0))
            box[0] = f"{host}:{s.getsockname()[1]}"
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _initialize_jax(world: int, rank: int) -> None:
    import jax

    from ..compat.jax_backend import jax_backends_started

    jax.config.update("jax_enable_x64", True)  # else jax turns int64 steps and keys (and float64) into 32 bits
    if jax.distributed.is_initialized():
        if jax.process_count() != world or jax.process_index() != rank:
            raise RuntimeError(
                f"jax.distributed already runs {jax.process_count()} processes (this one {jax.process_index()}), but "
                f"torch.distributed runs {world} (this one rank {rank}); checkpoints need the same processes in the "
                f"same order. Initialise jax with num_processes=world_size, process_id=rank, or leave it to ember."
            )
        return
    if jax_backends_started():
        raise RuntimeError(
            f"a multi-process checkpoint needs jax.distributed (torch.distributed runs {world} processes), but jax "
            f"already started its backend in this process without it. Build the CheckpointManager (on every rank) "
            f"before anything runs jax code, or call jax.distributed.initialize(num_processes={world}, "
            f"process_id=rank, coordinator_address=...) first."
        )
    keep_jax_on_cpu()  # orbax's arrays live in host memory; leave accelerators to torch
    jax.distributed.initialize(coordinator_address=_coordinator_address(), num_processes=world, process_id=rank,
                               initialization_timeout=120)


def _spec_of(placements: Sequence[Any], names: Sequence[str], ndim: int) -> Tuple[Any, ...]:
    """The PartitionSpec entries of DTensor `placements` (mesh order = major first, as ember lowers them)."""
    axes: List[List[str]] = [[] for _ in range(ndim)]
    for name, p in zip(names, placements):
        if p.is_shard():
            axes[p.dim].append(name)
    return tuple(None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes)


def _splits_evenly(shape: Sequence[int], spec: Tuple[Any, ...], sizes: Dict[str, int]) -> bool:
    for n, entry in zip(shape, spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if n % math.prod(sizes[a] for a in names):
            return False
    return True


class Distributed:
    """This process's view of a multi-process checkpoint: the jax devices of every rank, and conversions.

    Building it joins jax.distributed (a collective: every rank builds one).

    Raises:
        RuntimeError: jax already started without jax.distributed, or with other processes.
    """

    def __init__(self) -> None:
        import jax

        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        _initialize_jax(self.world, self.rank)
        by_process: Dict[int, Any] = {}
        for d in jax.devices():
            by_process.setdefault(d.process_index, d)
        self.devices = [by_process[r] for r in range(self.world)]  # one device per process, in rank order
        self._meshes: Dict[Tuple[Any, ...], Any] = {}

    def _jax_mesh(self, ranks: Sequence[Sequence[int]], shape: Tuple[int, ...], names: Tuple[str, ...]) -> Any:
        from jax.sharding import Mesh

        key = (tuple(np.asarray(ranks).reshape(-1).tolist()), shape, names)
        if key not in self._meshes:
            devices = np.array([self.devices[r] for r in key[0]], dtype=object).reshape(shape)
            self._meshes[key] = Mesh(devices, names)
        return self._meshes[key]

    def _replicated(self) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self._jax_mesh([list(range(self.world))], (self.world,), ("process",)), PartitionSpec())

    def _layout(self, device_mesh: Any, placements: Sequence[Any], shape: Tuple[int, ...]) -> Optional[Any]:
        """The `NamedSharding` of a DTensor layout, or None when a dimension does not split evenly."""
        from jax.sharding import NamedSharding, PartitionSpec

        names = tuple(device_mesh.mesh_dim_names or [f"axis{i}" for i in range(device_mesh.ndim)])
        spec = _spec_of(placements, names, len(shape))
        if not _splits_evenly(shape, spec, dict(zip(names, device_mesh.shape))):
            return None
        mesh = self._jax_mesh(device_mesh.mesh.tolist(), tuple(device_mesh.shape), names)
        return NamedSharding(mesh, PartitionSpec(*spec))

    def global_array(self, x: torch.Tensor) -> Any:
        """The global `jax.Array` of one state leaf, this process supplying its own shard.

        A DTensor keeps its layout (a pending sum is summed first; an uneven split is saved whole);
        a plain tensor must be equal on every process and is saved replicated. The shard is copied,
        so training may overwrite `x` while an async save runs.
        """
        import jax

        shape = tuple(x.shape)
        sharding, local = self._replicated(), x
        if is_dtensor(x):
            from torch.distributed.tensor import Replicate

            if any(p.is_partial() for p in x.placements):  # a pending sum: make it whole first
                x = x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])
            sharding = self._layout(x.device_mesh, x.placements, shape)
            local = x.to_local() if sharding is not None else x.full_tensor()
            sharding = sharding or self._replicated()
        host = np.array(to_numpy(local.detach().cpu()), copy=True)
        return jax.make_array_from_single_device_arrays(shape, sharding, [jax.device_put(host, self.devices[self.rank])])

    def restore_args(self, shape: Tuple[int, ...], placements: Optional[Sequence[Any]], device_mesh: Any) -> Any:
        """orbax restore args that read only this process's shard of a leaf laid out as `placements`.

        Without placements, or for an uneven split, the whole array is read (replicated).
        """
        import orbax.checkpoint as ocp

        sharding = None if placements is None else self._layout(device_mesh, placements, shape)
        return ocp.ArrayRestoreArgs(sharding=sharding or self._replicated(), global_shape=shape)

    def to_tensor(self, array: Any, placements: Optional[Sequence[Any]], device_mesh: Any, lowering: Any,
                  spec: Any) -> torch.Tensor:
        """The restored leaf: a DTensor built from this process's shard (or placed from the full array)."""
        from torch.distributed.tensor import DTensor

        local = from_numpy(np.asarray(array.addressable_shards[0].data), device="cpu")
        if placements is None:
            return local
        shape = tuple(array.shape)
        if self._layout(device_mesh, placements, shape) is None:
            return lowering.place(local, spec)  # the full array was read: slice it like `shard` does
        if lowering.device_type != "cpu":
            local = local.to(lowering.device_type)
        return DTensor.from_local(local, device_mesh, list(placements), run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())


def numpy_restore_args(tree: Any) -> Any:
    """orbax restore args reading every array of a saved item's metadata tree whole, as numpy."""
    import orbax.checkpoint as ocp

    if isinstance(tree, dict):
        return {k: numpy_restore_args(v) for k, v in tree.items()}
    return ocp.RestoreArgs(restore_type=np.ndarray)


def restore_sharded(dist_: Distributed, read_items: Callable[[Dict[str, Any]], Dict[str, Any]], meta: Any, like: Any,
                    like_flat: Any, sharding: Any, axes: Any) -> Any:
    """The state of `like`'s structure laid out as `shard(like, sharding, axes=axes)` would, read shard by shard.

    Args:
        dist_: this process's `Distributed`.
        read_items: `{item: orbax restore args} -> {item: restored tree}` for the step.
        meta: the step's `CheckpointMeta` (already checked against `like`).
        like: the template; like_flat: it flattened (`template_specs`).
        sharding: a `Sharding` with a DTensor lowering; axes: the model's logical axes.
    """
    import orbax.checkpoint as ocp

    from ..partition_specs.sharding import flatten_specs, specs_like_params
    from ..pytree import tree_unflatten
    from ._restore import assemble_leaves
    from ._tree import nest, unnest

    params = getattr(like, "params", like)
    specs = specs_like_params(like, params, sharding.param_specs(axes, params))
    spec_leaves = flatten_specs(specs)
    spec_of = dict(zip(like_flat.paths, spec_leaves))
    lowering = sharding.lowering
    device_mesh = lowering.device_mesh
    saved = {leaf.path: leaf for leaf in meta.leaves}
    placements = {p: lowering.placements(spec_of[p], len(leaf.shape)) for p, leaf in saved.items()}
    stored = [p for p, leaf in saved.items() if leaf.size]
    args = {p: dist_.restore_args(saved[p].shape, placements[p], device_mesh) for p in stored}
    restored: Dict[str, Any] = {}
    items = nest(args, like_flat.keys)
    if items:
        read = read_items({name: ocp.args.PyTreeRestore(restore_args=tree) for name, tree in items.items()})
        for tree in read.values():
            restored.update(unnest(tree))

    def make(path: str, source: str) -> torch.Tensor:
        leaf = saved[source]
        if leaf.size:
            return dist_.to_tensor(restored[source], placements[source], device_mesh, lowering, spec_of[source])
        return lowering.place(torch.empty(leaf.shape, dtype=getattr(torch, leaf.dtype)), spec_of[source])

    out = assemble_leaves(meta, like_flat, make)
    return tree_unflatten(out, like_flat.treedef)

