"""Sharding wiring of a run under torchrun: process group, mesh, and a step that runs sharded.

    torchrun --nproc-per-node 2 launch/train.py --mesh dp=2 --steps 5
    torchrun --nproc-per-node 4 launch/train.py --mesh fsdp=2,tp=2

Under torchrun (`WORLD_SIZE` set) every process joins the default process group (NCCL on GPUs,
gloo on CPU), the mesh is validated against the world size (`dp=-1` when `--mesh` is not given)
and lowered to DTensor. Every process reads the same global batches; `shard_batch` keeps each
process's slice. The wrapped step and eval run inside `use_sharding` and return metrics gathered to
plain tensors, equal on every process, so the loop and the metrics writer stay unchanged; only
rank 0 writes files and prints.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ember.core.compat import torch_minor
from ember.core.mesh import Mesh
from ember.core.partition_specs import MESH_ORDER, Sharding, for_mesh, shard, shard_batch, use_sharding
from ember.core.pytree import tree_map


def setup(mesh_text: Optional[str]) -> Optional[Sharding]:
    """The run's `Sharding`, or None for a plain single-process run (no `--mesh`, no torchrun).

    Raises:
        MeshError: the mesh does not use exactly `WORLD_SIZE` processes (says what would fit).
        ValueError: `--mesh` given without torchrun (names the torchrun command).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "WORLD_SIZE" not in os.environ:
        if mesh_text is None:
            return None
        raise ValueError(
            f"--mesh {mesh_text} runs one process per device under torchrun (DTensor), but WORLD_SIZE is not set: "
            f"start it as `torchrun --nproc-per-node N launch/train.py --mesh {mesh_text} ...` with N the mesh size, "
            f"or drop --mesh for a single process (launch/tpu_pod.py runs a mesh on torch_xla)."
        )
    mesh = Mesh.parse(mesh_text or "dp=-1", devices=world, backend="dtensor").in_order(MESH_ORDER)
    return Sharding(mesh, for_mesh(mesh.names))


_MOE_TP_FIRST_RIGHT = (2, 13)
"""The first torch measured to compile a mixture of experts under tensor parallelism right on DTensor (2.9
was wrong; 2.10-2.12 are unmeasured and refused)."""


def check_moe_tensor_parallel(backend: str, sharding: Optional[Sharding], model: Any) -> None:
    """Refuse a compiled mixture of experts with `tp` on DTensor where torch computes it wrong.

    torch 2.9's Inductor path over DTensor leaves collectives of the experts' tensor-parallel
    matmuls unwaited: `--mesh tp=2` and `ep=2,tp=2` ran to losses off by 3.5e-4 at step 1 and
    1.7e-2 at step 2, different every run. Eager is right, and so are 2.13 and 2.15.
    """
    tp = 1 if sharding is None else sharding.mesh.sizes().get("tp", 1)
    if tp == 1 or backend != "inductor" or not callable(getattr(model, "auxiliary_loss", None)):
        return
    if tuple(int(v) for v in torch_minor().split(".")) < _MOE_TP_FIRST_RIGHT:
        raise ValueError(
            f"torch {torch.__version__} compiles a mixture of experts under tensor parallelism (tp={tp}) to a wrong "
            f"step on DTensor (collectives left unwaited; measured on 2.9, right from 2.13): pass --backend eager, "
            f"drop tp from --mesh, or use torch >= 2.13.")


def is_main() -> bool:
    """True on rank 0 (and in a single-process run): the process that writes and prints."""
    return not dist.is_initialized() or dist.get_rank() == 0


def shard_state(state: Any, sharding: Optional[Sharding], model: Any) -> Any:
    """`state` placed by the layout (params rules; optimizer state inherits), or as it is."""
    return state if sharding is None else shard(state, sharding, axes=model.axes)


def gathered(tree: Any, sharding: Optional[Sharding]) -> Any:
    """Every tensor of `tree` as a full plain tensor (a collective: call it on every process)."""
    if sharding is None:
        return tree
    return tree_map(lambda x: sharding.lowering.gather(x) if isinstance(x, torch.Tensor) else x, tree)


def sharded(fn: Callable, sharding: Optional[Sharding], *, returns_state: bool) -> Callable:
    """`fn(first, batch)` run on the sharded batch inside `use_sharding`, with its metrics gathered.

    Args:
        fn: a step `(state, batch) -> (state, metrics)` or an eval `(params, batch) -> metrics`.
        sharding: the run's sharding (None: `fn` itself).
        returns_state: True for a step, False for an eval.
    """
    if sharding is None:
        return fn

    def run(first: Any, batch: Any) -> Any:
        with use_sharding(sharding):
            out = fn(first, shard_batch(batch, sharding))
        if returns_state:
            return out[0], gathered(out[1], sharding)
        return gathered(out, sharding)

    return run


def on_every_rank(flag: Callable[[], bool]) -> Callable[[], bool]:
    """`flag` as all processes see it: True on every rank once it is True on any (a collective: call
    the result on every process at the same point). Ranks that stop must stop at the same step, or
    the others wait forever in the next step's collectives.

    The vote is a one-element all-reduce on the CPU (over gloo), so it never waits for the GPU.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def agreed() -> bool:
        vote = torch.tensor([int(flag())])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
        return bool(vote[0])

    return agreed


def teardown(*, finished: bool) -> None:
    """Leave the process group (if this run joined one).

    A run that `finished` waits for every rank first: only rank 0 reports and samples at the end, and a
    rank that tore its gloo group down while a peer still held its end now and then died in
    "terminate called without an active exception" (SIGABRT after all the work was done). A run that
    failed does not wait: its peers may never arrive.
    """
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
