"""Collectives XLA's SPMD partitioner emits for one Llama block, forward and forward+backward.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=N XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" \\
        python tests/partition_specs/_xla_comm_hlo.py DIR MESH [MESH ...]
    python tests/partition_specs/_xla_comm_hlo.py --all          # every layout, a table on stdout

One Llama-3 block (d=64, 4 heads, 2 KV heads, SwiGLU 256, RoPE; batch 8 x 16 tokens) under
`use_sharding` with `for_mesh(mesh)`: parameters stored by the params rules (`shard`), the
input by `shard_batch`, gradients laid out like their parameters (as a training step leaves
them). For each mesh it compiles the forward (loss only) and the forward+backward (loss and
gradients), reads XLA's optimized HLO from the dump (`*after_optimizations.txt`) and counts
all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute with their shapes.
Prints one JSON object on its last stdout line (`--all`: a markdown table instead).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(\S+)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
LAYOUTS = {2: ["dp=2", "tp=2"], 4: ["fsdp=4", "fsdp=2,tp=2", "dp=2,tp=2"]}
D, H, KV, F, B, T = 64, 4, 2, 256, 8, 16


def count_collectives(hlo_text: str) -> dict:
    """`{op: [result shape, ...]}` for every collective in an HLO module's text."""
    found = collections.defaultdict(list)
    for shape, op in _OP.findall(hlo_text):
        found[op].append(shape)
    return dict(found)


def _new_module(dump: str, before: set) -> str:
    files = [f for f in glob.glob(os.path.join(dump, "*SyncTensorsGraph*after_optimizations.txt")) if f not in before]
    assert len(files) == 1, f"expected one new compiled module in {dump}, found {files}"
    return files[0]


def run(dump: str, meshes) -> dict:
    import torch

    from ember.core import random
    from ember.core import xla as ember_xla
    from ember.core.mesh import Mesh
    from ember.core.partition_specs import Sharding, for_mesh, shard, shard_batch, use_sharding
    from ember.core.partition_specs.xla import enable_spmd
    from ember.core.pytree import tree_leaves, tree_map
    from ember.models import build_model

    enable_spmd()
    model = build_model("llama3", "tiny", vocab_size=64, d_model=D, n_heads=H, n_kv_heads=KV, ffn_dim=F,
                        n_layers=1, max_seq_len=T, scan_layers=False)
    blocks = model.children["blocks"]  # one Llama block (a Sequential of one), no loop around it
    params = model.init(random.key(0))["blocks"]
    axes = model.axes["blocks"]
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))
    out = {}
    for text in meshes:
        mesh = Mesh.parse(text, devices=int(os.environ["CPU_NUM_DEVICES"]), backend="xla")
        sharding = Sharding(mesh, for_mesh(mesh.names))
        p = shard(params, sharding, axes=axes)
        specs = sharding.param_specs(axes, params)
        xs = shard_batch(x, sharding, axes=("batch", "sequence", "embed"))
        pos = torch.arange(T).to(sharding.lowering.device)

        def loss_fn(p, xs):
            return blocks.apply(p, xs, positions=pos).square().mean()

        result = {}
        for what in ("forward", "forward+backward"):
            before = set(glob.glob(os.path.join(dump, "*")))
            with use_sharding(sharding):
                if what == "forward":
                    outputs = [loss_fn(p, xs)]
                else:
                    grads, loss = torch.func.grad_and_value(loss_fn)(p, xs)
                    grads = tree_map(lambda g, s: sharding.lowering.constrain(g, s), grads, specs)
                    outputs = [loss, *tree_leaves(grads)]
            ember_xla.sync(outputs, wait=True)
            result[what] = count_collectives(open(_new_module(dump, before)).read())
        out[text] = result
    return out


def _table(results: dict) -> str:
    lines = ["| layout | graph | " + " | ".join(COLLECTIVES) + " |", "|---|---|" + "---|" * len(COLLECTIVES)]
    for mesh, res in results.items():
        for what, ops in res.items():
            cells = []
            for op in COLLECTIVES:
                shapes = ops.get(op, [])
                cells.append(f"{len(shapes)}" + (f" ({', '.join(f'{n}x {s}' for s, n in collections.Counter(shapes).items())})"
                                                 if shapes else ""))
            lines.append(f"| {mesh} | {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_all() -> dict:
    results = {}
    for n, meshes in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as dump:
            env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(n),
                       XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=SyncTensorsGraph.*")
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), dump, *meshes], env=env,
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            results.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


if __name__ == "__main__":
    if sys.argv[1:] == ["--all"]:
        res = run_all()
        print(_table(res))
        print(json.dumps(res))
    else:
        print(json.dumps(run(sys.argv[1], sys.argv[2:])))
