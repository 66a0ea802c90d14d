"""Subprocess body for `test_muon_xla.py`: Muon + AdamW groups on torch_xla SPMD meshes against one device.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=N XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" \\
        python tests/partition_specs/_xla_muon_worker.py DIR MESH [MESH ...]

For every mesh (of all N devices) and both placements: the model and optimizer of `_muon_dtensor_worker.setup` (a
tiny Llama, or a tiny Qwen3-MoE on a mesh with `ep`; the placements are sharding constraints from the model's
logical axes), `STEPS` steps of `jit(train_step, backend="xla")` against the same steps
eagerly on the CPU, the compiles per step, the largest parameter difference, and the collectives XLA's SPMD
partitioner put in a graph of one optimizer update alone (`tx.update`, read from the optimized HLO dump, with
`_xla_moe_worker.collectives`). Prints one JSON object on its last stdout line.
"""

from __future__ import annotations

import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _muon_dtensor_worker as M  # noqa: E402
from _xla_moe_worker import collectives  # noqa: E402


def _new_module(dump: str, before: set):
    """The largest HLO module compiled since `before`, or None: XLA found the graph in its cache (a placement
    that constrains nothing new compiles the graph of the mesh's other placement)."""
    files = set(glob.glob(os.path.join(dump, "*after_optimizations.txt"))) - before
    return max(files, key=os.path.getsize) if files else None


def run_mesh(text: str, placement: str, dump: str, cached: dict) -> dict:
    from ember.core import xla as ember_xla
    from ember.core.jit import jit
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import MESH_ORDER, Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.pytree import tree_leaves, tree_leaves_with_path
    from ember.core.step_fns import train_step
    from ember.models import lm_loss

    model, tx, state, batches = M.setup(text, placement)
    step = train_step(lm_loss(model), tx)
    ref = state
    for batch in batches:
        ref, _ = step(ref, batch)
    mesh = Mesh.parse(text, devices=int(os.environ["CPU_NUM_DEVICES"]), backend="xla").in_order(MESH_ORDER)
    sharding = Sharding(mesh, for_mesh(mesh.names))
    low = sharding.lowering
    state = shard(state, sharding, axes=model.axes)
    compiled = jit(step, backend="xla")
    per_step = []
    with use_sharding(sharding):
        for batch in batches:
            before = compiled.compile_count
            state, _ = compiled(state, shard_batch(batch, sharding))
            per_step.append(compiled.compile_count - before)
        files = set(glob.glob(os.path.join(dump, "*after_optimizations.txt")))
        updates, opt_state = tx.update(state.params, state.opt_state, state.params)  # any params-shaped tree
        ember_xla.sync([*tree_leaves(updates), *tree_leaves(opt_state)], wait=True)
        module = _new_module(dump, files)
        hlo = cached[text] if module is None else collectives(open(module).read())
        cached[text] = hlo
    diff = max(float((low.gather(x) - ref_x).abs().max())
               for (_, x), (_, ref_x) in zip(tree_leaves_with_path(state.params), tree_leaves_with_path(ref.params)))
    return {"max_param_diff": diff, "per_step_compiles": per_step, "update_collectives": hlo}


def main(argv) -> None:
    from ember.core.partition_specs.xla import enable_spmd

    dump, meshes = argv[0], argv[1:]
    enable_spmd()  # before any XLA tensor
    cached: dict = {}  # mesh -> its last update's collectives
    print(json.dumps({f"{text} {placement}": run_mesh(text, placement, dump, cached)
                      for text in meshes for placement in M.PLACEMENTS}))


if __name__ == "__main__":
    main(sys.argv[1:])
