"""`DTensorLowering`: run a `PartitionSpec` as DTensor placements on a torch.distributed `DeviceMesh`.

Public names: `DTensorLowering`, `placements`, `redistribute`.

The lowering is thin (ember convention 12): it turns a spec into one placement per mesh
dimension and calls DTensor. A tensor dimension `d` whose spec entry names mesh axis `a` gets
`Shard(d)` on `a`'s mesh dimension; every mesh dimension no tensor dimension uses is `Replicate()`.
A dimension split over two mesh axes (`("dp", "fsdp")`, major first) gets `Shard(d)` on both,
which DTensor applies in mesh order, so the major axis must also come first in the mesh.

    spec                     mesh dp=2,fsdp=2,tp=2       placements
    PartitionSpec("tp", "fsdp")                          [Replicate(), Shard(1), Shard(0)]
    PartitionSpec(("dp", "fsdp"), None, None)            [Shard(0), Shard(0), Replicate()]

One process per device, started by `torchrun` (or any launcher that initialises the default
process group: NCCL on GPUs, gloo on CPU). `context()` is DTensor's `implicit_replication()`, so
the plain tensors a model makes on the fly (an `arange` of positions, a causal mask) combine with
DTensors as if replicated.

Inside compute, `constrain` is a redistribution whose backward returns the gradient to the
input's placements, a pending sum becoming whole: FSDP's per-layer all-gather has the
reduce-scatter of the gradient as its backward, the tensor-parallel residual constraint is
Megatron's all-reduce, and a replicated parameter used on a split batch gets its gradient
all-reduced once, in the backward (DDP). It is an `autograd.Function` with `setup_context`
because under `torch.func.grad` the model sees functorch wrappers, not DTensors. Dynamo cannot
trace that Function inside `torch.func.grad` (torch 2.9), so in a compiled step the constraints
inside the gradient transform are skipped: DTensor's own op rules pick the redistributions (the
results are the same; gradients come back as pending sums, all-reduced where the optimizer first
needs them whole). `compat/dtensor_rules.py` adds the sharding rules torch 2.9 lacks or gets wrong
(select, gather, vector norms of pending sums, logsumexp, CPU scaled-dot-product attention).

Example (two gloo processes; see `tests/partition_specs/test_dtensor_matrix.py`):

    mesh = Mesh.parse("fsdp=2", devices=dist.get_world_size(), backend="dtensor")
    sharding = Sharding(mesh, for_mesh(mesh.names))         # builds DTensorLowering(mesh)
    state = shard(state, sharding, axes=model.axes)
    with use_sharding(sharding):
        state, metrics = step(state, shard_batch(batch, sharding))
"""

from __future__ import annotations

import itertools
import os
from typing import Any, ContextManager, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..mesh import Mesh, MeshError
from ..trace_context import here, implicitly_replicated
from ..compat import dtensor_rules
from .rules import ShardingRuleError
from .spec import PartitionSpec

__all__ = ["DTensorLowering", "placements", "redistribute"]

_MSG_NO_PROCESS_GROUP = (
    "the DTensor backend needs an initialised torch.distributed process group (one process per "
    "device), but none is running. Start the script with torchrun, e.g. `torchrun --nproc-per-node "
    "{n} launch/train.py --mesh {mesh}`, or call torch.distributed.init_process_group('gloo' on CPU, "
    "'nccl' on GPUs) before building the Sharding. For a single process use no mesh at all."
)


_MSG_TOO_FEW_GPUS = (
    "torchrun started {procs} processes on this host, but it has {gpus} GPU(s), and NCCL runs one process per "
    "GPU. Start `torchrun --nproc-per-node {gpus}` with a mesh of that size, or run the {procs} processes on the "
    "CPU over gloo with CUDA_VISIBLE_DEVICES= (empty)."
)


def start_torchrun_process_group() -> None:
    """Join the process group torchrun describes in the environment: NCCL on GPUs, gloo on CPU.

    On GPUs each process takes the GPU of its `LOCAL_RANK` (`torch.cuda.set_device`) and binds the
    group to it (`device_id`), so NCCL connects eagerly on that device instead of guessing it.

    Raises:
        MeshError: torchrun started more processes on this host than it has GPUs.
    """
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    procs, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1))), torch.cuda.device_count()
    if max(procs, local_rank + 1) > gpus:
        raise MeshError(_MSG_TOO_FEW_GPUS.format(procs=max(procs, local_rank + 1), gpus=gpus))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", device_id=torch.device("cuda", local_rank))


def placements(spec: PartitionSpec, mesh_names: Sequence[str], *, ndim: int) -> List[Any]:
    """One DTensor placement per mesh axis for a tensor of `ndim` dimensions laid out as `spec`.

    Args:
        spec: the tensor's `PartitionSpec` (one entry per dimension).
        mesh_names: the mesh axis names, in mesh order.
        ndim: the tensor's number of dimensions.

    Returns:
        A list, in mesh order, of `Shard(d)` (tensor dim `d` is split over that mesh axis) or
        `Replicate()`.

    Raises:
        ShardingRuleError: the spec has the wrong length, names an axis the mesh lacks, uses one
            axis twice, or splits a dimension over several axes in an order other than the mesh's.

    Example:
        >>> placements(PartitionSpec("tp", ("dp", "fsdp")), ("dp", "fsdp", "tp"), ndim=2)
        [Shard(dim=1), Shard(dim=1), Shard(dim=0)]
    """
    from torch.distributed.tensor import Replicate, Shard

    spec = PartitionSpec(*spec)
    names = tuple(mesh_names)
    if len(spec) != ndim:
        raise ShardingRuleError(
            f"{spec} has {len(spec)} entries but the tensor has {ndim} dimensions; give one entry (None, "
            f"a mesh axis or a tuple of axes) per dimension."
        )
    out: List[Any] = [Replicate() for _ in names]
    used = {}
    for d in range(ndim):
        axes = spec.mesh_axes_of(d)
        for a in axes:
            if a not in names:
                raise ShardingRuleError(
                    f"{spec}: dimension {d} names mesh axis {a!r}, but the mesh has axes {names}; fix the rule "
                    f"or add {a}=1 to the mesh."
                )
            if a in used:
                raise ShardingRuleError(
                    f"{spec}: mesh axis {a!r} splits both dimension {used[a]} and dimension {d}; a mesh axis "
                    f"can split at most one dimension of a tensor."
                )
            used[a] = d
            out[names.index(a)] = Shard(d)
        order = [names.index(a) for a in axes]
        if order != sorted(order):
            raise ShardingRuleError(
                f"{spec}: dimension {d} is split over {axes} (major first), but the mesh orders those axes "
                f"{tuple(sorted(axes, key=names.index))}; DTensor splits in mesh order. Write the tuple in "
                f"mesh order, {tuple(sorted(axes, key=names.index))}, or reorder the mesh axes."
            )
    return out


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


class _Redistribute(torch.autograd.Function):
    """`x.redistribute(mesh, placements)` that also works inside `torch.func` transforms.

    Its backward returns the gradient to the input's placements, a pending sum (`Partial`)
    becoming `Replicate`, as DTensor's own redistribute does (see the module docstring). Under
    `torch.func.grad` the model sees functorch wrappers: `isinstance(x, DTensor)` is False there,
    and `DTensor.redistribute` (an autograd.Function without `setup_context`) cannot run; this
    Function's forward receives the DTensor itself.
    """

    @staticmethod
    def forward(x: torch.Tensor, device_mesh: Any, want: Tuple[Any, ...]) -> Tuple[torch.Tensor, Any]:
        # Also returns x's placements: setup_context sees the transform's wrappers, forward the DTensor.
        if not _is_dtensor(x):
            return x.view_as(x), None
        source = tuple(x.placements)
        return (x.view_as(x) if source == want else x.redistribute(device_mesh, want)), source

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[torch.Tensor, Any]) -> None:
        ctx.device_mesh = inputs[1]
        ctx.source = output[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any = None) -> Tuple[Any, None, None]:
        if ctx.source is None:
            return grad, None, None
        from torch.distributed.tensor import Replicate

        want = tuple(Replicate() if p.is_partial() else p for p in ctx.source)
        # Under torch.func the gradient is a functorch wrapper again: redistribute it through this
        # Function, whose forward sees the DTensor inside (and which is itself differentiable).
        return _Redistribute.apply(grad, ctx.device_mesh, want)[0], None, None


def redistribute(x: torch.Tensor, device_mesh: Any, want: Sequence[Any]) -> torch.Tensor:
    """`x` laid out as `want` on `device_mesh`, its gradient returned to `x`'s placements (a pending sum whole):
    `constrain`'s redistribution, by placements."""
    return _Redistribute.apply(x, device_mesh, tuple(want))[0]


class DTensorLowering:
    """The `Lowering` of `ember.core.partition_specs.sharding` on a torch.distributed `DeviceMesh`.

    Builds `init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.names)` over the
    running process group ("cuda" when a GPU is visible, else "cpu").

    Args:
        mesh: the ember `Mesh` (backend "dtensor"); its size must equal the world size.

    Raises:
        RuntimeError: no process group is initialised (start with torchrun).
        MeshError: the mesh does not use exactly the world size.
    """

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        if dist.is_available() and not dist.is_initialized() and "MASTER_ADDR" in os.environ:
            start_torchrun_process_group()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(_MSG_NO_PROCESS_GROUP.format(n=mesh.size, mesh=mesh))
        mesh.validate(dist.get_world_size())
        from torch.distributed.device_mesh import init_device_mesh

        dtensor_rules.install()
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._device_mesh = init_device_mesh(self.device_type, mesh.shape, mesh_dim_names=mesh.names)
        self._slices: dict = {}
        if mesh.sizes().get("pp", 1) > 1:  # a pipeline's stages compute on slices of the other axes: cut them now
            others = [n for n in mesh.names if n != "pp" and mesh[n] > 1]
            for chosen in itertools.product((False, True), repeat=len(others)):
                if any(chosen):
                    self.slice([n for n, c in zip(others, chosen) if c])

    @classmethod
    def on(cls, mesh: Mesh, device_mesh: Any) -> "DTensorLowering":
        """The lowering of `mesh` on a `DeviceMesh` already built (a slice of a larger one, whose axes it
        names): what the stages of a pipeline compute on, the processes of their other axes."""
        if tuple(device_mesh.mesh_dim_names or ()) != mesh.names:
            raise MeshError(f"a DeviceMesh with axes {device_mesh.mesh_dim_names} cannot lower the mesh {mesh}; slice "
                            f"the DeviceMesh by the mesh's axis names.")
        self = cls.__new__(cls)
        self.mesh, self.device_type, self._device_mesh, self._slices = mesh, device_mesh.device_type, device_mesh, {}
        return self

    def slice(self, names: Sequence[str]) -> "DTensorLowering":
        """The lowering of the mesh's axes `names` (in mesh order) on the processes this one shares the other axes'
        coordinates with. Cached: slicing a `DeviceMesh` runs tensor ops, which a compiled step's trace would
        record, so the slices a pipeline uses are cut when the lowering is built."""
        key = tuple(names)
        if key not in self._slices:
            sub = self._device_mesh[key] if len(key) > 1 else self._device_mesh[key[0]]
            self._slices[key] = DTensorLowering.on(Mesh(tuple((n, self.mesh[n]) for n in key)), sub)
        return self._slices[key]

    @property
    def device_mesh(self) -> Any:
        """The torch.distributed `DeviceMesh` (dimension names are the mesh axis names)."""
        return self._device_mesh

    def __repr__(self) -> str:
        return f"DTensorLowering({self.mesh!r}, device_type={self.device_type!r})"

    def placements(self, spec: PartitionSpec, ndim: int) -> List[Any]:
        """`placements(spec, mesh.names, ndim=ndim)`: one DTensor placement per mesh axis."""
        return placements(spec, self.mesh.names, ndim=ndim)

    def place(self, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
        """Distribute a full tensor, equal on every process, as `spec` (each rank slices its shard locally).

        An existing DTensor is redistributed instead.
        """
        from torch.distributed.tensor import distribute_tensor

        if _is_dtensor(x):
            return x.redistribute(self._device_mesh, self.placements(spec, x.dim()))
        # src_data_rank=None: every rank already holds the full value, so no broadcast/scatter.
        return distribute_tensor(x.detach(), self._device_mesh, self.placements(spec, x.dim()), src_data_rank=None)

    def constrain(self, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
        """Redistribute a DTensor to `spec` (differentiable, also under `torch.func` transforms).

        A plain tensor comes back as it is (a view): under `implicit_replication()` it acts as
        replicated.
        """
        want = tuple(self.placements(spec, x.dim()))
        if here().tracer == "dynamo":
            if _is_dtensor(x):  # outside a torch.func transform Dynamo sees the DTensor itself
                return x.redistribute(self._device_mesh, want)
            return x  # Dynamo cannot trace the Function under torch.func: DTensor's op rules decide
        return _Redistribute.apply(x, self._device_mesh, want)[0]

    def local_shape(self, x: torch.Tensor) -> Tuple[int, ...]:
        """The shape of this process's shard (the full shape for a plain tensor)."""
        return tuple(x.to_local().shape) if _is_dtensor(x) else tuple(x.shape)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The full tensor as a plain CPU tensor (a collective: call it on every process)."""
        full = x.full_tensor() if _is_dtensor(x) else x
        return full.detach().cpu()

    def context(self) -> ContextManager[None]:
        """`implicit_replication()`: plain tensors mixed with DTensors count as replicated, entered once however
        deeply lowerings nest (a pipeline's stages run on a slice of the mesh)."""
        return implicitly_replicated()
