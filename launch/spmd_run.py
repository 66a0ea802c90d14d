"""One torch_xla SPMD run (`launch/tpu_pod.py`): shard the state over the mesh, train, checkpoint, check.

The step is `ember.core.jit(..., backend="xla")` under `use_sharding`; every step's loss and compile
count are kept, and on CPU the losses are compared with a single-device eager run of the same
batches (they must agree within 1e-4, and only step 1 may compile).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

from ember import data
from ember.core import jit
from ember.core.mesh import Mesh
from ember.core.partition_specs import MESH_ORDER, Sharding, for_mesh, shard, shard_batch, use_sharding
from ember.core.partition_specs.report import describe_sharding
from ember.launch import build, checkpointing
from ember.launch.interrupt import GracefulStop
from ember.launch.profiling import XlaStepProfiler
from ember.launch.metrics_log import MetricsWriter
from ember.launch.run_config import TrainConfig
from ember.launch.sharded import check_mesh, context_parallel, pipeline_schedule
from ember.launch.trackers import open_trackers

__all__ = ["train"]


def train(cfg: TrainConfig, args: argparse.Namespace, *, say: Callable[..., None], stop: GracefulStop) -> int:
    """Train `cfg` on the mesh `args.mesh` over every XLA device; 0, or 1 if `args.check` failed.

    Reads the launcher flags `mesh`, `check`, `config`, `resume`, `resume_step` of `args`.
    """
    import torch_xla.runtime as xr  # imported here: the module imports without torch_xla

    check = args.check if args.check is not None else os.environ.get("PJRT_DEVICE", "").upper() == "CPU"
    mesh = Mesh.parse(args.mesh, devices=xr.global_runtime_device_count(), backend="xla").in_order(MESH_ORDER)
    model = build.build_model(cfg)
    check_mesh("xla", mesh, model, say=say, seq_len=cfg.data.seq_len)  # e.g. experts that do not split over ep
    tokenizer, sharding = build.build_tokenizer(cfg, model), Sharding(mesh, for_mesh(mesh.names),
                                                                   pipeline=pipeline_schedule(cfg))
    state0 = build.initial_state(cfg, model)
    say(f"{sharding.lowering!r}, {xr.process_count()} process(es)")
    say(describe_sharding(state0, sharding, axes=model.axes))
    data_iter = data.build_batches(cfg.data, tokenizer=tokenizer, context_parallel=context_parallel(sharding),
                                   reference_logps=build.precomputed_reference(cfg, model, state0.params, tokenizer))
    if args.resume_step is not None:
        checkpointing.set_aside_steps_after(cfg, args.resume_step, main=xr.process_index() == 0, log=say)
    ckpt, info = checkpointing.build_manager(cfg), checkpointing.model_info_for(cfg, arch=args.config)
    state = checkpointing.maybe_resume(ckpt, shard(state0, sharding, axes=model.axes), data_iter, cfg=cfg,
                                       resume=args.resume, step=args.resume_step, model_info=info, sharding=sharding,
                                       axes=model.axes, log=say)
    first = int(state.step)
    cfg.profile.check(steps=cfg.steps, start=first)  # --profile.steps before the resumed step: refused
    main = xr.process_index() == 0  # --log.wandb / --log.mlflow: the first process logs each step's loss
    writer = MetricsWriter(None, tensorboard=False, trackers=open_trackers(cfg, cfg.out if main else None,
                                                                           resumed=first > 0))
    try:
        return _train(cfg, state, state0, model, data_iter, ckpt, info, sharding, first, writer, check, say, stop)
    finally:
        writer.close()


def _train(cfg, state, state0, model, data_iter, ckpt, info, sharding, first, writer, check, say, stop):
    step_fn = build.step_fn(cfg, model)
    step = jit(step_fn, backend="xla", donate="state")
    losses, compiles, batches = [], [], []
    profiler = XlaStepProfiler(cfg.profile, cfg.out or ".", say=say) if cfg.profile.steps else None  # --profile.steps
    start = time.perf_counter()
    with use_sharding(sharding):
        for n, batch in zip(range(first + 1, cfg.steps + 1), data_iter):
            if profiler is not None:
                profiler.step_started(n)
            before = step.compile_count
            state, metrics = step(state, shard_batch(batch, sharding))
            compiles.append(step.compile_count - before)
            losses.append(metrics["loss"])
            batches.append(batch)
            if profiler is not None:
                profiler.step_done(n)
            if checkpointing.save_if_due(ckpt, n, state, data_iter, cfg=cfg, model_info=info, sharding=sharding):
                writer.record_checkpoint(n, checkpointing.checkpoint_dir(cfg) + f"/{n}")
            if stop.requested():  # one process per host: each host stops after the step it is in
                break
    saved = checkpointing.finish(ckpt, state, data_iter, cfg=cfg, writer=writer, model_info=info, sharding=sharding)
    losses = [float(sharding.lowering.gather(x)) for x in losses]  # host sync, after the loop
    for i, loss in enumerate(losses):
        writer.write(first + i + 1, {"loss": loss})
    say(f"trained {len(losses)} steps in {time.perf_counter() - start:.1f}s (step 1 with compiling: "
        f"{step.compile_seconds:.1f}s)")
    for i, (loss, c) in enumerate(zip(losses, compiles)):
        say(f"step {first + i + 1}: loss {loss:.6f}, compiled {c}")
    stop.raise_if_stopped(step=first + len(losses), steps=cfg.steps, checkpoint_dir=ckpt and ckpt.directory,
                          saved_step=saved)
    if not check or first:
        return 0  # (a resumed run has no single-device reference from its own start)
    return _check_against_reference(jit(step_fn, backend="eager"), state0, batches, losses, compiles, say)


def _check_against_reference(reference, state, batches, losses, compiles, say):
    """0 if the single-device eager run of the same batches gives the same losses (1e-4) and only step 1 compiled."""
    ref_losses = []
    for batch in batches:
        state, metrics = reference(state, batch)
        ref_losses.append(float(metrics["loss"]))
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    say(f"check: max |loss - single-device loss| = {diff:.3g} over {len(losses)} steps; compiles per step {compiles}")
    ok = diff < 1e-4 and compiles == [1] + [0] * (len(compiles) - 1)
    say("check passed" if ok else "CHECK FAILED: expected a loss difference < 1e-4 and one compile, at step 1")
    return 0 if ok else 1
