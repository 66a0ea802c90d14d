"""Two gloo processes run `pipeline` over the mesh `pp=2`, eagerly and compiled; rank 0 writes the loss,
the gradients (gathered whole) and the collectives counted to `--out/results.json`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _processes
from _processes import end_gloo_rank  # noqa: E402


CASES = {"eager": 2, "compiled": 2, "eager, two stages a process": 4}  # name -> stages (4 layers, 4 microbatches)


def _worker(rank: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import test_pipeline_stages as T
    from ember.core.partition_specs.pipeline import pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), 2), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    counts = {"all_to_alls": 0, "all_gathers": 0}
    results = {}
    for case, stages in CASES.items():
        try:
            params, x = T.stack(4), torch.randn(8, T.D, dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(1))
            dparams = {k: distribute_tensor(v, mesh, [Shard(0)]).requires_grad_() for k, v in params.items()}
            dx = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()

            def fn(p, h, stages=stages):
                return pipeline(T.layer, p, h, stages=stages, microbatches=4).square().mean()

            step = torch.compile(fn, backend="inductor") if case.startswith("compiled") else fn
            with CommDebugMode() as comm:  # functional collectives, dispatched eagerly or traced
                loss = step(dparams, dx)
                grads = torch.autograd.grad(loss, [dparams["w"], dparams["b"], dx])
            for op, n in comm.get_comm_counts().items():
                name = str(op)
                counts["all_to_alls"] += n if "all_to_all_single" in name else 0
                counts["all_gathers"] += n if "all_gather" in name else 0
            whole = [g.full_tensor() for g in grads]
            results[case] = {"loss_and_grads": [loss.full_tensor().tolist()] + [g.tolist() for g in whole],
                             "local_w": list(dparams["w"].to_local().shape), **counts}
        except Exception:
            results[case] = {"error": traceback.format_exc()[-4000:]}
        counts.update(all_to_alls=0, all_gathers=0)
    if rank == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f)
    end_gloo_rank()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch.multiprocessing as mp

    os.makedirs(args.out, exist_ok=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
    mp.start_processes(_worker, args=(args.out,), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
