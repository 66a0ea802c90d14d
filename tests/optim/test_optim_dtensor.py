"""Every optimizer in OPTIMIZERS_UNDER_TEST runs on DTensor params and state (2 gloo ranks,
matrices sharded on dim 0) and matches the single-device result.

This guards the choice of `torch._foreach_*` overloads: DTensor has sharding rules for only some
of them (no `_foreach_add.Tensor`, `_foreach_sign`, `_foreach_pow`), so ember.optim uses the ones
it has, or a per-leaf fallback for DTensors. Runs in a subprocess that spawns the two ranks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp

    def worker(rank, world, port, out_path, testlib_dir):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
        from torch.distributed.tensor import distribute_tensor
        from ember import optim
        from ember.core import pytree
        sys.path.insert(0, testlib_dir)
        import optim_testlib as T

        mesh = DeviceMesh("cpu", list(range(world)))

        def shard(t):  # params, grads and every state leaf: matrices Shard(0), the rest Replicate
            if isinstance(t, DTensor):
                return t
            return distribute_tensor(t, mesh, [Shard(0)] if t.ndim >= 2 else [Replicate()])

        def full(tree):
            return pytree.tree_map(lambda t: t.full_tensor(), tree)

        results = {}
        for case in T.OPTIMIZERS_UNDER_TEST:
            tx = case.make()
            params = pytree.tree_map(shard, T.mlp_params())
            state = pytree.tree_map(shard, tx.init(params))
            try:
                for _ in range(3):
                    grads = pytree.tree_map(shard, T.mlp_grad(full(params)))
                    updates, state = tx.update(grads, state, params)
                    params = optim.apply_updates(params, updates)
                ref, _ = T.run_steps(case.make(), T.mlp_params(), T.mlp_grad, 3)
                results[case.id] = T.max_abs_diff(ref, full(params))
            except Exception as err:  # report every failing case, not just the first
                results[case.id] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        sys.path.insert(0, os.path.dirname(testlib_dir))  # tests/: _processes
        from _processes import end_gloo_rank
        end_gloo_rank()

    if __name__ == "__main__":
        port, out_path, testlib_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the ranks run on the CPU, a GPU host too
        mp.spawn(worker, args=(2, port, out_path, testlib_dir), nprocs=2)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # spawns two gloo ranks (about 15 s on 2 cores)
def test_optimizers_on_sharded_dtensors_match_single_device(tmp_path):
    script, out = tmp_path / "dtensor_optim.py", tmp_path / "results.json"
    script.write_text(SCRIPT)
    testlib_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, str(script), str(_free_port()), str(out), testlib_dir],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    bad = {k: v for k, v in results.items() if not (isinstance(v, float) and v < 1e-6)}
    assert not bad, bad
