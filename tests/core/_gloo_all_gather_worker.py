"""Workers for `test_compat_gloo_all_gather.py`, started as 2 gloo processes by torchrun.

    torchrun --nproc-per-node 2 tests/core/_gloo_all_gather_worker.py repro funcol|out ITERS IN_FLIGHT
    torchrun --nproc-per-node 2 tests/core/_gloo_all_gather_worker.py jit ITERS OUT_JSON

The default (gloo) group has one worker thread. `repro` is plain torch (no ember): IN_FLIGHT
functional all-gathers in flight (`all_gather_into_tensor`, or `all_gather_into_tensor_out` with
`out`), then their waits, ITERS times. `jit` runs a `jit(backend="inductor")` function of 8
`fsdp`-sharded DTensors (each all-gathered, the gathers independent, so Inductor issues them before
it waits) ITERS times, checks the result against eager, and rank 0 writes which all-gather ops the
compiled code calls to OUT_JSON.
A heap corrupted by the coalesced gloo all-gather aborts the process (SIGABRT / SIGSEGV).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _processes
from _processes import end_gloo_rank  # noqa: E402

SHAPES = [(320, 96), (96,), (192, 96), (64, 96), (64, 96), (96, 96), (96,), (512, 96)]  # a small Llama's


def _one_thread_gloo_options():
    """Options of a gloo group with one worker thread: each collective queues behind the earlier ones."""
    opts = dist.ProcessGroupGloo._Options()
    opts._threads = 1
    opts._timeout = datetime.timedelta(seconds=120)
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return opts


def repro(api: str, iters: int, in_flight: int) -> None:
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)

    ops = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    world = dist.get_world_size()
    params = [torch.randn(SHAPES[i % len(SHAPES)]) for i in range(in_flight)]
    for _ in range(iters):
        pending = []
        for p in params:
            if api == "funcol":
                pending.append(ops.all_gather_into_tensor.default(p, world, group))
            else:
                out = torch.empty(p.shape[0] * world, *p.shape[1:])
                pending.append(ops.all_gather_into_tensor_out.default(p, world, group, out=out))
        junk = [object() for _ in range(200)]  # small allocations and a kernel meanwhile
        torch.randn(64, 64) @ torch.randn(64, 64)
        for t in pending:
            ops.wait_tensor.default(t)
        del pending, junk


def run_jit(iters: int, out_json: str) -> None:
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ember.core import jit

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    torch.manual_seed(0)
    full = [torch.randn(shape) for shape in SHAPES]
    sharded = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]

    def f(params):
        gathered = [p.redistribute(mesh, [Replicate()]).to_local() for p in params]
        return sum(g.square().sum() for g in gathered)

    step = jit(f)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out, codes = run_and_get_code(step, sharded)
    code = "\n".join(codes)
    expected = sum(t.square().sum() for t in full)
    torch.testing.assert_close(out, expected)
    for _ in range(iters):
        out = step(sharded)
    torch.testing.assert_close(out, expected)
    if dist.get_rank() == 0:
        with open(out_json, "w") as fh:
            json.dump({"coalesced": len(re.findall(r"\ball_gather_into_tensor\.default\(", code)),
                       "out": len(re.findall(r"\ball_gather_into_tensor_out\.default\(", code))}, fh)


if __name__ == "__main__":
    dist.init_process_group("gloo", pg_options=_one_thread_gloo_options())
    if sys.argv[1] == "repro":
        repro(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        run_jit(int(sys.argv[2]), sys.argv[3])
    print("WORKER_OK", dist.get_rank(), flush=True)
    end_gloo_rank()  # a barrier: every rank's work is done before either exits
