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

import contextlib
import os
from typing import Any, Callable, ContextManager, Iterator, Optional, Union

import torch
import torch.distributed as dist

from ember.core.mesh import Mesh
from ember.core.partition_specs import (MESH_ORDER, Sharding, for_mesh, resolve_tree, shard, shard_batch,
                                        use_sharding)
from ember.core.partition_specs.context_parallel import check_dtensor_can_split_sequences, head_tail_order
from ember.core.partition_specs.pipeline import PipelineSchedule
from ember.core.pytree import tree_leaves, tree_map
from ember.models.layers.moe import check_tensor_parallel


def setup(mesh_text: Optional[str], *, nproc_per_node: Optional[int] = None,
          pipeline: Optional[PipelineSchedule] = None) -> Optional[Sharding]:
    """The run's `Sharding`, or None for a plain single-process run (no `--mesh`, no torchrun); `pipeline`
    is how stacked layers run when the mesh has `pp`.

    Raises:
        MeshError: the mesh does not use exactly `WORLD_SIZE` processes (says what would fit).
        ValueError: `--mesh` given without torchrun (names the launcher's command); `--nproc-per-node`
            other than `WORLD_SIZE` under torchrun.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if nproc_per_node is not None and "WORLD_SIZE" in os.environ and nproc_per_node != world:
        raise ValueError(f"--nproc-per-node {nproc_per_node} under torchrun, which started {world} processes: drop "
                         f"--nproc-per-node (torchrun starts the ranks), or run `python launch/train.py "
                         f"--nproc-per-node {nproc_per_node} ...` without torchrun.")
    if "WORLD_SIZE" not in os.environ:
        if mesh_text is None:
            return None
        raise ValueError(
            f"--mesh {mesh_text} runs one process per device (DTensor), but this is one process: start it as "
            f"`python launch/train.py --nproc-per-node N --mesh {mesh_text} ...` with N the mesh size (or under "
            f"torchrun), or drop --mesh for a single process (launch/tpu_pod.py runs a mesh on torch_xla)."
        )
    mesh = Mesh.parse(mesh_text or "dp=-1", devices=world, backend="dtensor").in_order(MESH_ORDER)
    return Sharding(mesh, for_mesh(mesh.names), pipeline=pipeline)


def pipeline_schedule(cfg: Any) -> PipelineSchedule:
    """The run config's pipeline options (`--pipeline_microbatches`, `--pipeline_repeats`)."""
    return PipelineSchedule(cfg.pipeline_microbatches, cfg.pipeline_repeats)


def context_parallel(sharding: Optional[Sharding]) -> int:
    """The mesh's `cp` (1 without one): the data pipeline orders each sequence for it (`ember.data.ContextOrder`)."""
    return 1 if sharding is None else sharding.mesh.sizes().get("cp", 1)


def _has_axis(axes: Any, name: str) -> bool:
    """True if some parameter of the `axes` tree has the logical axis `name`."""
    if isinstance(axes, tuple) and all(a is None or isinstance(a, str) for a in axes):
        return name in axes
    values = axes.values() if isinstance(axes, dict) else axes if isinstance(axes, (list, tuple)) else ()
    return any(_has_axis(v, name) for v in values)


def check_mesh(backend: str, sharding: Union[Sharding, Mesh, None], model: Any, *, say: Callable[[str], None],
               seq_len: Optional[int] = None) -> None:
    """The checks of a run's mesh that need no process group, so a launcher makes them before it starts ranks.

    The ready-made layout is resolved against the model's parameter shapes (e.g. 8 experts over `ep=3`
    is refused, naming the degrees that fit); a compiled mixture of experts under `tp` is refused where
    torch computes it wrong; `pp` needs the blocks as one stack (`scan_layers`); `cp` needs a sequence
    (`seq_len`) of two chunks per process and a model without experts; `ep` on a model without experts is
    no mistake (it is then one more batch axis, as `dp`), but `say` gets a one-line notice.
    """
    mesh = getattr(sharding, "mesh", sharding)
    if mesh is None:
        return
    ep, pp, cp = mesh.sizes().get("ep", 1), mesh.sizes().get("pp", 1), mesh.sizes().get("cp", 1)
    if cp > 1 and seq_len is not None:
        head_tail_order(seq_len, cp)  # a ContextParallelError naming the lengths that split
    if cp > 1 and mesh.backend == "dtensor":
        check_dtensor_can_split_sequences()  # where this torch's DTensor cannot
    if cp > 1 and _has_axis(model.axes, "expert"):
        raise ValueError(f"--mesh {mesh}: cp does not run mixture-of-experts models yet (their tokens are dispatched "
                         f"whole-sequence); drop cp from the mesh (ep, fsdp and tp split them).")
    if pp > 1 and not _has_axis(model.axes, "layers"):
        raise ValueError(f"--mesh {mesh} splits the layers into pp={pp} stages, but this model's blocks are a list, not "
                         f"one stack: pass --model.scan_layers true (or drop pp from the mesh).")
    if pp > 1:
        _check_layers_split(mesh, pp, model)
    resolve_tree(model.axes, for_mesh(mesh.names).params, mesh_sizes=mesh.sizes(), shapes=model.param_shapes())
    check_moe_tensor_parallel(backend, mesh, model)
    if ep > 1 and not _has_axis(model.axes, "expert"):
        say(f"note: --mesh {mesh} splits experts over ep={ep}, but this model has none: ep acts as one more "
            f"data-parallel axis here (the same as dp={ep})")


def _stacked_layers(model: Any) -> Optional[int]:
    """The size of the model's `layers` axis (its stacked blocks), or None without one."""
    axes = tree_leaves(model.axes, is_leaf=lambda a: isinstance(a, tuple) and all(x is None or isinstance(x, str)
                                                                                  for x in a))
    for names, shape in zip(axes, tree_leaves(model.param_shapes())):
        if "layers" in names:
            return int(shape.shape[names.index("layers")])
    return None


def _check_layers_split(mesh: Mesh, pp: int, model: Any) -> None:
    """Refuse stacked blocks that do not split evenly into `pp` stages, naming the layer counts that do."""
    layers = _stacked_layers(model)
    if layers is None or layers % pp == 0:
        return
    fits = [n for n in range(2, layers + 1) if layers % n == 0]
    other = f", or a pp among {', '.join(map(str, fits))}" if fits else ""
    n_layers = getattr(getattr(model, "config", None), "n_layers", None)
    more = (f"pass --model.n_layers {layers + pp - layers % pp}" if n_layers == layers else
            f"change the layer count (--model.n_layers) so that the {layers} stacked layers become a multiple of {pp}")
    stacked = f"{layers} stacked layer{'s do' if layers != 1 else ' does'}"
    raise ValueError(f"--mesh {mesh} splits the layers into pp={pp} stages, but the model's {stacked} not split into "
                     f"{pp} equal stages: {more} (a multiple of {pp}){other}.")


def check_moe_tensor_parallel(backend: str, sharding: Union[Sharding, Mesh, None], model: Any) -> None:
    """Before the run starts: what the model's MoE layers refuse when they are traced (`check_tensor_parallel`)."""
    if callable(getattr(model, "auxiliary_loss", None)):
        check_tensor_parallel(getattr(sharding, "mesh", sharding), compiled=backend == "inductor")


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


class AnotherRankFailed(ValueError):
    """This rank's checks passed, but another rank's failed (that rank says why); every rank exits 2."""


@contextlib.contextmanager
def entered_on_every_rank(context: ContextManager[Any]) -> Iterator[None]:
    """Enter `context` (e.g. rank 0's claim of the run directory) as one decision of all ranks (a collective).

    If entering raised a mistake on any rank, every rank raises before its first step: that rank its
    own error, the others `AnotherRankFailed`; otherwise a rank that went on alone would wait for the
    failed one in a collective until gloo or NCCL gave up with a traceback.
    """
    with contextlib.ExitStack() as stack:
        failed = None
        try:
            stack.enter_context(context)
        except (ValueError, TypeError, LookupError, OSError, NotImplementedError) as error:  # cli.USER_ERRORS
            failed = error
        if on_every_rank(lambda: failed is not None)():
            if failed is not None:
                raise failed
            raise AnotherRankFailed("another rank refused to start the run (rank 0 printed why)")
        yield


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
