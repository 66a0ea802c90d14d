"""Stage c: the run config's compiled step twice from one seed (bitwise the same?), with references.

    python -m ember.launch.device_check.repeat --config llama3_tiny --steps 5 [config overrides]

Runs `steps` compiled steps twice in this process from the same initial state and compares the
bits; the gpu check runs it in two processes and compares their digests too (`summary`). References:
the same steps eagerly on this device, the initial loss eagerly on the CPU in float32, and ember's
counter RNG compiled here against eager on the CPU. Last, a checkpoint round trip of the state and
whether it started JAX (orbax), with the free GPU memory around it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Dict

import torch

from ember.core import device_for, jit, random
from ember.core.pytree import tree_leaves
from ember.launch import build
from ember.launch.benchmark.setup import sync
from ember.launch.run_config import parse_cli

from .common import count_warnings, digest, emit


def _run_twice(cfg: Any, model: Any, batch: Dict[str, torch.Tensor], device: torch.device, steps: int):
    step = jit(build.step_fn(cfg, model), backend=cfg.backend, donate="state")
    runs, states = [], []
    for _ in range(2):
        state, losses, t0 = build.initial_state(cfg, model, device), [], time.perf_counter()
        for i in range(steps):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
            if i == 0:
                sync(device)
                first = time.perf_counter() - t0
        sync(device)
        rest = (time.perf_counter() - t0 - first) / max(steps - 1, 1)
        runs.append({"first_call_s": round(first, 2), "ms_per_step_after": round(1e3 * rest, 2),
                     "losses": [float(x) for x in losses], "state": digest(state)})  # host sync
        states.append(state)
    return step, runs, states


def _references(cfg: Any, model: Any, batch: Dict[str, torch.Tensor], device: torch.device, steps: int,
                compiled: Any, losses: list) -> Dict[str, Any]:
    eager = jit(build.step_fn(cfg, model), backend="eager", donate="state")
    state, eager_losses = build.initial_state(cfg, model, device), []
    for _ in range(steps):
        state, metrics = eager(state, batch)
        eager_losses.append(float(metrics["loss"]))  # host sync
    diff = max(float((a - e).abs().max()) for a, e in zip(tree_leaves(compiled.params), tree_leaves(state.params)))
    cpu_batch = {k: v.cpu() for k, v in batch.items()}
    cpu_loss = float(build.eval_fn(cfg, model)(build.initial_state(cfg, model, "cpu").params, cpu_batch)["loss"])
    return {"eager_losses": eager_losses, "cpu_initial_loss": cpu_loss,
            "rel_diff_first_loss_vs_cpu": abs(losses[0] - cpu_loss) / abs(cpu_loss),
            "rel_diff_last_loss_vs_eager": abs(losses[-1] - eager_losses[-1]) / abs(eager_losses[-1]),
            "max_abs_param_diff_vs_eager": diff}


def _rng(cfg: Any, device: torch.device) -> Dict[str, Any]:
    """ember's counter RNG promises the same numbers on every device and backend."""
    draw = lambda k: (random.bits(k, (4096,)), random.uniform(k, (4096,)), random.normal(k, (4096,)))  # noqa: E731
    want = draw(random.key(7))
    got = jit(draw, backend=cfg.backend)(random.key(7, device=device))
    names = ("bits", "uniform", "normal")
    return {"same_as_cpu": {n: bool(torch.equal(g.cpu(), w)) for n, g, w in zip(names, got, want)},
            "normal_max_abs_diff": float((got[2].cpu() - want[2]).abs().max())}


def _checkpoint(cfg: Any, model: Any, state: Any, device: torch.device, step: int) -> Dict[str, Any]:
    from ember.core.checkpoint import CheckpointManager
    from ember.core.compat.jax_backend import jax_backends_started

    free = (lambda: round(torch.cuda.mem_get_info()[0] / 2**30, 1)) if device.type == "cuda" else (lambda: None)
    free_before, t0 = free(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as root:
        mgr = CheckpointManager(os.path.join(root, "ckpt"), async_save=False)
        mgr.save(step, state, force=True)
        mgr.wait()
        free_after = free()
        restored, _, _ = mgr.restore(like=build.initial_state(cfg, model, device))
        mgr.close()
    return {"roundtrip_bitwise": digest(restored) == digest(state), "seconds": round(time.perf_counter() - t0, 1),
            "gpu_free_gib_before": free_before, "gpu_free_gib_after_save": free_after,
            "jax_backends_started": jax_backends_started()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="llama3_tiny")
    p.add_argument("--steps", type=int, default=5, help="compiled steps per repeat")
    args, overrides = p.parse_known_args(argv)
    res: Dict[str, Any] = {"torch": torch.__version__}
    try:
        cfg, device = parse_cli(args.config, overrides), device_for("inductor")
        model = build.build_model(cfg)
        res.update(device=str(device), backend=cfg.backend, compute_dtype=cfg.compute_dtype, steps=args.steps)
        tokens = random.randint(random.key(1234), (cfg.data.batch_size, cfg.data.seq_len + 1), 0, cfg.model.vocab_size)
        batch = {"inputs": tokens[:, :-1].to(device), "targets": tokens[:, 1:].to(device)}  # (B, T) each
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step, runs, states = _run_twice(cfg, model, batch, device, args.steps)
            res.update(runs=runs, compile_count=step.compile_count, compile_seconds=round(step.compile_seconds, 1),
                       bitwise_same_in_process=runs[0]["state"] == runs[1]["state"])
            res.update(_references(cfg, model, batch, device, args.steps, states[0], runs[0]["losses"]))
            res["rng"] = _rng(cfg, device)
        res["warnings"] = count_warnings(caught)
        res["checkpoint"] = _checkpoint(cfg, model, states[1], device, args.steps)
    except Exception as e:  # noqa: BLE001 - the stage reports any failure on its result line
        res["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    emit("repeat", res)
    return 1 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
