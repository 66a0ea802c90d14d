"""Subprocess body for tests/partition_specs/test_moe_xla.py: a tiny Qwen3-MoE trained on torch_xla
SPMD meshes with expert parallelism, each against the single-device eager reference.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=N XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" \\
        python tests/partition_specs/_xla_moe_worker.py [--family deepseek_v3] [--configs dropless] DIR MESH [MESH ...]

Every mesh has size N (a torch_xla mesh covers all devices) and is laid out in `MESH_ORDER`, as
the launchers lay it out. Two configs: dropless (`capacity_factor=None`) and one that drops
(`capacity_factor=0.5`). For each config and mesh it trains `STEPS` steps on fresh batches (so
the routing changes) and records the losses, `moe_dropped` and `moe_max_load` per step, the
compiles per step, the largest differences from the eager run in the first and last steps'
gradients and in the final parameters, and the collectives of the compiled step, read from XLA's
optimized HLO in DIR. Prints one JSON object on its last stdout line.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys
import time

import torch

from ember import optim
from ember.core import TrainState, random
from ember.core.jit import jit
from ember.core.mesh import Mesh
from ember.core.partition_specs import MESH_ORDER, Sharding, for_mesh, shard, shard_batch, use_sharding
from ember.core.partition_specs.xla import enable_spmd
from ember.core.pytree import tree_leaves_with_path
from ember.core.step_fns import train_step
from ember.core.tree_math import tree_zeros_like
from ember.models import build_model, lm_loss

from _moe_dtensor_worker import FAMILIES  # family -> what it changes in MOE (this folder is on the path)

# T=12 tokens, d=32: the exchanged buffer's trailing dims (C, d) = (12, 32) dropless, (2, 32) at 0.5
# match no weight (I=24, H*D=32, KV*D=16, E=8, V=64), so the test can tell its collectives apart.
MOE = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, attn_head_dim=8, ffn_dim=64, n_layers=2,
           max_seq_len=16, n_experts=8, experts_per_token=2, moe_ffn_dim=24, tie_embeddings=True)
CONFIGS = {"dropless": None, "dropping": 0.5}
STEPS, BATCH, SEQ = 4, 8, 12
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# A collective's result: one shape, or a tuple of shapes (XLA:CPU's all-to-all has one operand per peer).
_OP = re.compile(r"=\s*(\([^)]*\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(.*?replica_groups=(\S+)")
_DIMS = re.compile(r"\w+\[([\d,]*)\]")


def _group_size(groups: str) -> int:
    """Devices per replica group, from `{{0,1},{2,3}}` or the iota form `[2,2]<=[4]`."""
    if groups.startswith("{{"):
        return len(groups[2:].split("}", 1)[0].split(","))
    return int(groups[1:].split("]", 1)[0].split(",")[-1])


def collectives(hlo_text: str) -> dict:
    """`{op: [{"dims": [dims of each result], "group": devices per group}, ...]}` for an HLO module's text."""
    found = collections.defaultdict(list)
    for shape, op, groups in _OP.findall(hlo_text):
        dims = [[int(n) for n in d.split(",") if n] for d in _DIMS.findall(shape)]
        found[op].append({"dims": dims, "group": _group_size(groups)})
    return dict(found)


def keep_grads() -> optim.GradientTransformation:
    """Passes the gradients on unchanged and keeps them as its state (sharded like the params)."""
    return optim.GradientTransformation(lambda params: tree_zeros_like(params), lambda g, state, params=None: (g, g))


def setup(capacity_factor, family="qwen3_moe"):
    model = build_model(family, "tiny", **{**MOE, **FAMILIES[family]}, capacity_factor=capacity_factor)
    # SGD, not Adam: Adam divides by sqrt(v), so a weight whose gradient is ~0 can move by up to lr on a
    # 1e-7 difference in it; SGD keeps the parameter check as sharp as the gradient check.
    tx = optim.chain(keep_grads(), optim.sgd(0.1, momentum=0.9))
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, MOE["vocab_size"], (BATCH, SEQ + 1), generator=g)
        batches.append({"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()})
    return model, tx, state, batches


def _grads(state, gather=lambda x: x):
    return {p: gather(x) for p, x in tree_leaves_with_path(state.opt_state[0])}


def _max_diff(tree, ref):
    return max(float((tree[p] - ref[p]).abs().max()) for p in ref)


def run_eager(model, tx, state, batches):
    step = jit(train_step(lm_loss(model), tx), backend="eager")
    out = {"losses": [], "dropped": [], "max_load": []}
    for b in batches:
        state, metrics = step(state, b)
        if "grads_1" not in out:
            out["grads_1"] = _grads(state)
        for name, key in (("losses", "loss"), ("dropped", "moe_dropped"), ("max_load", "moe_max_load")):
            out[name].append(float(metrics[key]))
    out["grads_last"], out["params"] = _grads(state), dict(tree_leaves_with_path(state.params))
    return out


def _step_module(dump, before):
    """The largest HLO module compiled since `before` (the step; the others move inputs)."""
    files = set(glob.glob(os.path.join(dump, "*after_optimizations.txt"))) - before
    assert files, f"no new compiled module in {dump}: is XLA_FLAGS=--xla_dump_to set?"
    return max(files, key=os.path.getsize)


def run_mesh(text, dump, model, tx, state, batches, ref):
    t0 = time.perf_counter()
    mesh = Mesh.parse(text, devices=int(os.environ["CPU_NUM_DEVICES"]), backend="xla").in_order(MESH_ORDER)
    sharding = Sharding(mesh, for_mesh(mesh.names))
    low = sharding.lowering
    state = shard(state, sharding, axes=model.axes)
    step = jit(train_step(lm_loss(model), tx), backend="xla", donate="state")
    metrics_seen, per_step, hlo, grads_1 = [], [], None, None
    with use_sharding(sharding):
        for b in batches:
            before, files = step.compile_count, set(glob.glob(os.path.join(dump, "*after_optimizations.txt")))
            state, metrics = step(state, shard_batch(b, sharding))
            per_step.append(step.compile_count - before)
            metrics_seen.append({k: metrics[k] for k in ("loss", "moe_dropped", "moe_max_load")})
            if grads_1 is None:  # read now: the next step donates this state's buffers
                grads_1 = _grads(state, low.gather)
                hlo = collectives(open(_step_module(dump, files)).read())
    final = {p: low.gather(x) for p, x in tree_leaves_with_path(state.params)}
    return {"mesh": str(mesh), "per_step_compiles": per_step,
            "losses": [float(low.gather(m["loss"])) for m in metrics_seen],
            "dropped": [float(low.gather(m["moe_dropped"])) for m in metrics_seen],
            "max_load": [float(low.gather(m["moe_max_load"])) for m in metrics_seen],
            "grad_diff_first": _max_diff(grads_1, ref["grads_1"]),
            "grad_diff_last": _max_diff(_grads(state, low.gather), ref["grads_last"]),
            "param_diff": _max_diff(final, ref["params"]), "collectives": hlo, "seconds": time.perf_counter() - t0}


def main(argv):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILIES))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("dump")
    p.add_argument("meshes", nargs="+")
    args = p.parse_args(argv)
    dump, meshes = args.dump, args.meshes
    enable_spmd()  # before any XLA tensor
    out = {}
    for name in args.configs.split(","):
        model, tx, state, batches = setup(CONFIGS[name], args.family)
        ref = run_eager(model, tx, state, batches)
        out[name] = {"eager": {k: ref[k] for k in ("losses", "dropped", "max_load")}, "meshes": {}}
        for text in meshes:
            out[name]["meshes"][text] = run_mesh(text, dump, model, tx, state, batches, ref)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
