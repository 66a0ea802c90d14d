"""`XlaLowering`: run a `PartitionSpec` as torch_xla SPMD sharding annotations on an XLA `Mesh`.

Public names: `XlaLowering`, `xla_mesh`, `enable_spmd`, `dcn_split`, `partition_tuple`.

The lowering is thin (ember convention 12): the spec *is* the partition tuple of
`torch_xla.distributed.spmd.mark_sharding` (one entry per dimension: None, a mesh axis name or
a tuple of names, major first), so nothing is translated but the container. One process per
host drives every device of that host (SPMD): the program is written for the global shapes and
XLA's SPMD partitioner (GSPMD) inserts the collectives.

    place(x, spec)      x.to(xla device) + xs.mark_sharding(x, mesh, spec): the data is
                        stored split over the devices (parameters, optimizer state, batches).
    constrain(x, spec)  inside compute: a sharding annotation on a copy of `x` (XLA's
                        `custom-call @Sharding`, as JAX's `with_sharding_constraint`), and the
                        same annotation on its gradient in the backward pass. FSDP's per-layer
                        all-gather and the residual stream's layout are such constraints.
    local_shape(x)      the shape of one device's shard, read from the sharding (no transfer).
    gather(x)           x.cpu(): the full tensor (torch_xla gathers the shards).
    context()           nothing to enter (the annotations need no ambient state).

SPMD mode must be on before the torch_xla runtime starts (`enable_spmd`, called by
`XlaLowering`): build the `Sharding` before anything touches the XLA device (switching later
crashed the first sharded step with torch_xla 2.9, so it is refused with an error). On CPU,
`PJRT_DEVICE=CPU CPU_NUM_DEVICES=N` gives N virtual devices, enough for any mesh of size N.

Device order (`xla_mesh`): on CPU (and any non-TPU device) devices are laid out row-major in id
order, `Mesh(np.arange(n), mesh.shape, mesh.names)`. On TPU, `HybridMesh` orders them by the
physical torus (`ici_mesh_shape` = the mesh) and, on a multi-slice job, also splits the mesh
into an ICI part (inside a slice) and a DCN part (across slices). Multi-slice is detected from
the runtime's device attributes: several distinct `slice_index` values (torch_xla's own test; a
multi-host *single* slice, e.g. a v4-32 with 4 hosts, is all ICI and is not multi-slice).
`dcn_split` gives the slices to the outermost mesh axes first (`dp=8,tp=4` on 2 slices: dp=2
across slices x 4 inside, tp=4 inside), so tensor parallelism stays on the fast links.

Example (4 virtual devices; skipped as a doctest because the runtime must start in a fresh
process with the environment set):
    >>> import os; os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")  # doctest: +SKIP
    >>> from ember.core.mesh import Mesh
    >>> from ember.core.partition_specs import Sharding, for_mesh, shard
    >>> mesh = Mesh.parse("fsdp=2,tp=2", devices=4, backend="xla")  # doctest: +SKIP
    >>> sharding = Sharding(mesh, for_mesh(mesh.names))  # builds XlaLowering  # doctest: +SKIP
    >>> params = shard(params, sharding, axes=model.axes)  # doctest: +SKIP
    >>> sharding.lowering.local_shape(params["blocks"]["mlp"]["gate"]["weight"])  # doctest: +SKIP
    (n_layers, ffn_dim // 2, d_model // 2)
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from typing import Any, ContextManager, Optional, Sequence, Tuple

import torch

from ..compat import torch_xla as torch_xla_internals
from ..compat.functorch import functorch_base
from ..mesh import Mesh, MeshError
from ..xla import is_runtime_initialized, require_torch_xla, start_runtime
from .rules import ShardingRuleError
from .spec import PartitionSpec

__all__ = ["XlaLowering", "dcn_split", "enable_spmd", "partition_tuple", "xla_mesh"]

_MSG_RUNTIME_BEFORE_SPMD = (
    "torch_xla SPMD must be enabled before the torch_xla runtime starts, but it already started "
    "without SPMD{first}. Switching afterwards (torch_xla's use_spmd 'replicating tensors already "
    "initialized' path) crashes the first sharded training step with torch_xla 2.9 (measured: a "
    "segmentation fault). Build the Sharding (or call "
    "ember.core.partition_specs.xla.enable_spmd()) before anything touches the XLA device: "
    "wrong: `dev = torch_xla.device(); ...; Sharding(mesh, layout)`; right: "
    "`sharding = Sharding(mesh, layout); state = shard(state, sharding, axes=model.axes)`."
)


def _live_xla_tensors() -> list:
    """Tensors on an XLA device that are alive now (a one-off scan of the garbage collector)."""
    out = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "xla":
                out.append(obj)
        except Exception:  # objects whose isinstance/device access fails are not ours to judge
            continue
    return out


def enable_spmd() -> None:
    """Switch torch_xla to SPMD mode (`torch_xla.runtime.use_spmd()`) and start its runtime, once.

    A no-op when SPMD is already on. Call it (or build the `Sharding`, which does) before
    anything touches the XLA device. CPU backward passes (an eager reference) and XLA steps may
    run in any order, before or after it.

    Raises:
        ImportError: torch_xla is not installed.
        RuntimeError: the torch_xla runtime already started without SPMD (the first
            `torch_xla.device()` or XLA tensor); the message says to build the Sharding first.
    """
    require_torch_xla("the torch_xla SPMD lowering")
    import torch_xla.runtime as xr

    if xr.is_spmd():
        return
    if is_runtime_initialized():
        live = _live_xla_tensors()
        first = f" ({len(live)} XLA tensor(s) alive, the first of shape {tuple(live[0].shape)})" if live else ""
        raise RuntimeError(_MSG_RUNTIME_BEFORE_SPMD.format(first=first))
    xr.use_spmd()
    # Starts the runtime and probes autograd's per-device queues: if no backward ran yet, the
    # probe sizes them for the XLA devices; if a CPU backward ran first, `jit(backend="xla")`
    # runs XLA backward passes under `autograd_guard` (see ember.core.xla).
    start_runtime("the torch_xla SPMD lowering")


def dcn_split(shape: Sequence[int], slices: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Split a mesh shape into `(ici_shape, dcn_shape)` for `slices` slices, outermost axes first.

    Each axis takes as much of the remaining slice count as divides it, in mesh order (the mesh
    is written major axis first: data parallelism outside, tensor parallelism inside), so the
    cross-slice (DCN) traffic is data-parallel gradient reduction.

    Args:
        shape: the mesh axis sizes, major first.
        slices: number of slices (1: everything is ICI).

    Returns:
        `(ici_shape, dcn_shape)`, elementwise products equal to `shape`.

    Raises:
        MeshError: the slices cannot be spread over the axes (the product of the axes that
            divide does not reach `slices`).

    Example:
        >>> dcn_split((8, 4), 2)
        ((4, 4), (2, 1))
        >>> dcn_split((2, 2, 4), 4)
        ((1, 1, 4), (2, 2, 1))
    """
    if slices < 1:
        raise MeshError(f"dcn_split: the slice count must be >= 1, got {slices}.")
    left, ici, dcn = slices, [], []
    for size in shape:
        f = math.gcd(size, left)
        dcn.append(f)
        ici.append(size // f)
        left //= f
    if left != 1:
        raise MeshError(
            f"a mesh of shape {tuple(shape)} cannot be spread over {slices} slices: each slice must hold the "
            f"same whole sub-mesh, so {slices} must divide the outer axes; e.g. make the first axis a multiple "
            f"of {slices} (--mesh dp={slices}*k,...)."
        )
    return tuple(ici), tuple(dcn)


def _slice_count(attributes: Sequence[dict]) -> int:
    """Distinct `slice_index` values among the devices (1 when the runtime reports none)."""
    return len({a["slice_index"] for a in attributes if "slice_index" in a}) or 1


def xla_mesh(mesh: Mesh) -> Any:
    """The `torch_xla.distributed.spmd.Mesh` for an ember mesh (SPMD must be enabled).

    CPU / GPU: `Mesh(np.arange(n), mesh.shape, mesh.names)`. TPU: `HybridMesh` (physical
    topology order; ICI x DCN split by `dcn_split` when the devices span several slices). A
    single-slice mesh the torus cannot hold falls back to id order with a warning.

    Raises:
        MeshError: the mesh size differs from `torch_xla.runtime.global_runtime_device_count()`
            (the message says what would fit), or a multi-slice mesh does not map onto the slices.
    """
    require_torch_xla("xla_mesh()")
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    mesh.validate(xr.global_runtime_device_count())
    if (xr.device_type() or "").upper() == "TPU":
        slices = _slice_count(xr.global_runtime_device_attributes())
        ici, dcn = dcn_split(mesh.shape, slices)
        try:
            return xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn if slices > 1 else None,
                                 axis_names=mesh.names)
        except (AssertionError, NotImplementedError, ValueError) as err:
            if slices > 1:
                raise MeshError(f"mesh {mesh} (ICI {ici} x DCN {dcn} over {slices} slices) does not map onto the "
                                f"TPU topology: {err}; try another factorisation of the axes.") from err
            warnings.warn(f"mesh {mesh} does not map onto the TPU torus ({err}); using device id order, which "
                          f"is correct but may put an axis on slower links.", stacklevel=2)
    return xs.Mesh(np.arange(mesh.size), mesh.shape, mesh.names)


def partition_tuple(spec: PartitionSpec, mesh_names: Sequence[str], *, ndim: int) -> Tuple[Any, ...]:
    """The `mark_sharding` partition tuple for `spec` (checked: length, axis names, each axis once).

    Example:
        >>> partition_tuple(PartitionSpec(("dp", "fsdp"), None, "tp"), ("dp", "fsdp", "tp"), ndim=3)
        (('dp', 'fsdp'), None, 'tp')
    """
    spec = PartitionSpec(*spec)
    if len(spec) != ndim:
        raise ShardingRuleError(
            f"{spec} has {len(spec)} entries but the tensor has {ndim} dimensions; give one entry (None, a mesh "
            f"axis or a tuple of axes) per dimension."
        )
    used = spec.used_mesh_axes()
    for a in used:
        if a not in mesh_names:
            raise ShardingRuleError(f"{spec} names mesh axis {a!r}, but the mesh has axes {tuple(mesh_names)}.")
        if used.count(a) > 1:
            raise ShardingRuleError(f"{spec} uses mesh axis {a!r} for two dimensions; a mesh axis splits at most one.")
    return tuple(spec)


def _annotated(t: torch.Tensor, xmesh: Any, partition: Tuple[Any, ...]) -> torch.Tensor:
    """A copy of `t` whose IR node is a sharding custom-call (`t` itself is left alone).

    A copy, because annotating `t` in place would re-shard a parameter's stored buffer (device
    data) or change the layout every other user of the value sees.
    """
    import torch_xla.distributed.spmd as xs

    out = t.clone()
    xs.annotate_custom_sharding(functorch_base(out), xmesh, partition)
    return out


class _ShardingConstraint(torch.autograd.Function):
    """Identity that annotates its output, and in the backward pass its gradient, with a sharding."""

    @staticmethod
    def forward(x: torch.Tensor, xmesh: Any, partition: Tuple[Any, ...]) -> torch.Tensor:
        return _annotated(x, xmesh, partition)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.xmesh, ctx.partition = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:
        return _annotated(grad, ctx.xmesh, ctx.partition), None, None


class XlaLowering:
    """The `Lowering` of `ember.core.partition_specs.sharding` on torch_xla SPMD.

    Turns on SPMD mode (`enable_spmd`) and builds the device mesh (`xla_mesh`).

    Args:
        mesh: the ember `Mesh` (backend "xla"); its size must equal the global device count.

    Raises:
        ImportError: torch_xla is not installed.
        RuntimeError: the torch_xla runtime started before SPMD mode could be enabled.
        MeshError: the mesh does not use exactly the global device count.
    """

    def __init__(self, mesh: Mesh) -> None:
        torch_xla = require_torch_xla("the torch_xla SPMD lowering (mesh backend 'xla')")
        enable_spmd()
        self.mesh = mesh
        self._xla_mesh = xla_mesh(mesh)
        self.device = torch_xla.device()

    @property
    def xla_mesh(self) -> Any:
        """The `torch_xla.distributed.spmd.Mesh` (or `HybridMesh`) the annotations refer to."""
        return self._xla_mesh

    def __repr__(self) -> str:
        return f"XlaLowering({self.mesh!r}, mesh_type={type(self._xla_mesh).__name__})"

    def partition(self, spec: PartitionSpec, ndim: int) -> Tuple[Any, ...]:
        """`partition_tuple(spec, mesh.names, ndim=ndim)`."""
        return partition_tuple(spec, self.mesh.names, ndim=ndim)

    def place(self, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
        """Move a full tensor to the XLA device and store it split as `spec` (`xs.mark_sharding`).

        A tensor already on the XLA device goes through the host (`.cpu()`) to a new buffer, so
        the caller's tensor keeps its layout (a device-side copy keeps the source's sharding,
        which torch_xla refuses to overwrite).
        """
        import torch_xla.distributed.spmd as xs

        partition = self.partition(spec, x.dim())
        t = x.detach()
        if t.device.type == "xla":
            t = t.cpu()  # host sync: placing is done once, outside the step
        t = t.to(self.device)
        xs.mark_sharding(t, self._xla_mesh, partition)
        return t

    def constrain(self, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
        """`x` annotated as laid out by `spec` (forward value and gradient); a CPU tensor is returned as is."""
        if x.device.type != "xla":
            return x
        return _ShardingConstraint.apply(x, self._xla_mesh, self.partition(spec, x.dim()))

    def local_shape(self, x: torch.Tensor) -> Tuple[int, ...]:
        """The shape of the shard the first local device holds (the full shape when replicated).

        Reads the sharding metadata only; a tensor with pending (unsynced) work reports its
        sharding once it has been materialised.
        """
        if x.device.type != "xla":
            return tuple(x.shape)
        index = torch_xla_internals.local_shard_index(x)
        if index is Ellipsis:
            return tuple(x.shape)
        return tuple(len(range(*s.indices(n))) for s, n in zip(index, x.shape))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The full tensor on the CPU (`.cpu()`; torch_xla assembles the shards)."""
        return x.detach().cpu()

    def context(self) -> ContextManager[Any]:
        """Nothing to enter: SPMD annotations need no ambient state."""
        return contextlib.nullcontext()
