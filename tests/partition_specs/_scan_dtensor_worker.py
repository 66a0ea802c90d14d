"""Worker for `test_scan_dtensor.py`: a stack of layers over DTensors, `scan` and `remat_scan` compiled by ember's
`jit`, on 2 gloo processes; every rank writes, per case, the error against one device (relative to the largest
gradient element) and the scan nodes of the step's graph at two depths.

    python tests/partition_specs/_scan_dtensor_worker.py --world 2 --out DIR
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gloo_runs import serve  # noqa: E402

D = 8
# name: (mesh, how the stacked weights are placed, how the activations are placed, loop, remat policy)
CASES = {2: {
    "weights_split_by_rows": ("fsdp=2", "shard1", "replicate", "scan", None),
    "batch_split": ("dp=2", "replicate", "shard0", "scan", None),
    "weights_split_by_rows_remat_none": ("fsdp=2", "shard1", "replicate", "remat_scan", "none"),
    "weights_split_by_rows_remat_full": ("fsdp=2", "shard1", "replicate", "remat_scan", "full"),
    "weights_split_by_rows_remat_dots": ("fsdp=2", "shard1", "replicate", "remat_scan", "dots_saveable"),
    "layers_split": ("fsdp=2", "shard0", "replicate", "scan", None),  # no local slice: the Python loop
}}


def _loss(loop, policy):
    from ember.core.transforms import remat_scan, scan

    def loss(w, h0):
        if loop == "remat_scan":
            return remat_scan(lambda h, w_i, _: torch.tanh(h @ w_i), h0, w, policy=policy).pow(2).sum()
        h, ys = scan(lambda h, w_i: (torch.tanh(h @ w_i), h.sum(0)), h0, w)
        return h.pow(2).sum() + ys.pow(2).sum()
    return loss


def _compiled_graphs(fn, *args):
    """`fn(*args)` and the graphs ember's Inductor step compiled for it."""
    import ember.core.jit_backends.traced as traced

    graphs, trace = [], traced.trace_and_compile

    def spy(f, inputs, compile=None):
        def keep(gm, example):
            graphs.append(gm)
            return compile(gm, example)
        return trace(f, inputs, keep if compile is not None else None)

    traced.trace_and_compile = spy
    try:
        return fn(*args), graphs
    finally:
        traced.trace_and_compile = trace


def run(mesh_text: str, world: int, weights: str, activations: str, loop: str, policy) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ember.core import jit
    from ember.core.transforms import grad

    name, size = mesh_text.split("=")
    mesh = init_device_mesh("cpu", (int(size),), mesh_dim_names=(name,))
    placement = {"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1)}
    out = {}
    for n_layers in (4, 8):
        g = torch.Generator().manual_seed(n_layers)
        w, h0 = torch.randn(n_layers, D, D, generator=g) / 2, torch.randn(4, D, generator=g)
        loss = _loss(loop, policy)
        want = grad(loss, argnums=(0, 1))(w, h0)  # one device, eagerly
        dw, dh = distribute_tensor(w, mesh, [placement[weights]]), distribute_tensor(h0, mesh, [placement[activations]])
        step = jit(grad(loss, argnums=(0, 1)))
        got, graphs = _compiled_graphs(step, dw, dh)
        again = step(dw, dh)
        out[n_layers] = {
            # relative to the largest gradient element: Inductor sums a step's contributions in its own order
            "error": max(((a.full_tensor() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)),
            "same_bits": all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(got, again)),
            "scan_nodes": sum(node.op == "call_function" and str(node.target) == "scan"
                              for gm in graphs for node in gm.graph.nodes),
            "placements": [str(tuple(t.placements)) for t in got],
        }
    return out


if __name__ == "__main__":
    serve(CASES, run, "scan over DTensors compiled by ember's jit on gloo processes")
