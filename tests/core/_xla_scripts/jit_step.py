"""Subprocess body for tests/core/test_jit_xla.py: the tiny MLP step under jit(backend="xla").

Run with `PJRT_DEVICE=CPU CPU_NUM_DEVICES=1`. Prints one JSON object on its last stdout line:
eager reference losses and params after 20 steps; for donate="none" and donate="state": xla
losses, params after 20 steps, compile counts per step / after 1 and 20 steps / after an lr
change, timings, whether donation kept the tensors and how many buffers torch_xla aliased;
the compiles per step of plain lazy tracing without ember's input sync (for the report); and
the error for a CPU tensor argument; and the compiles per call of a step whose state holds
host-uploaded 0-d hyperparameters (`host_scalars_compiles_per_step`, per donate mode).
`--timing-steps N` adds a steady-state timing loop of N steps (default 0, for the test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import tiny_mlp as m  # noqa: E402
from ember.core import pytree  # noqa: E402
from ember.core import xla as ember_xla  # noqa: E402
from ember.core.jit import jit  # noqa: E402

STEPS = 20


def run_eager():
    step = jit(m.train_step, backend="eager")
    state, losses = m.init_state(), []
    for i in range(STEPS):
        state, metrics = step(state, m.make_batch(i))
        losses.append(metrics["loss"].item())
    return losses, state


def run_xla(donate, dev, timing_steps):
    import torch_xla
    import torch_xla.debug.metrics as met

    step = jit(m.train_step, backend="xla", donate=donate)
    state = m.init_state(dev)  # params transferred; opt_state zeros and step made lazily on device
    donated = pytree.tree_leaves(state)
    losses, counts, per_step = [], {}, []
    aliases_before = met.metric_data("InputOutputAliasCount")
    t0 = time.perf_counter()
    for i in range(STEPS):
        before = step.compile_count
        state, metrics = step(state, m.make_batch(i, dev))
        per_step.append(step.compile_count - before)
        if i == 0:
            torch_xla.sync(wait=True)
            first_call_s = time.perf_counter() - t0
            counts["after_1"] = step.compile_count
        losses.append(metrics["loss"])
    counts["after_20"] = step.compile_count
    same_tensors = all(a is b for a, b in zip(donated, pytree.tree_leaves(state)))
    params_20 = {k: v.cpu().tolist() for k, v in state.params.items()}
    losses = [float(t.cpu()) for t in losses]
    state = m.set_lr(state, 0.01)
    state, _ = step(state, m.make_batch(0, dev))
    counts["after_lr_change"] = step.compile_count
    steady_ms = None
    if timing_steps:
        batches = [m.make_batch(i, dev) for i in range(timing_steps)]
        torch_xla.sync(wait=True)
        t = time.perf_counter()
        for b in batches:
            state, metrics = step(state, b)
        torch_xla.sync(wait=True)
        steady_ms = 1e3 * (time.perf_counter() - t) / timing_steps
    aliases = met.metric_data("InputOutputAliasCount")
    return {
        "losses": losses,
        "counts": counts,
        "first_call_s": first_call_s,
        "compile_seconds": step.compile_seconds,
        "steady_ms": steady_ms,
        "per_step_compiles": per_step,
        "same_tensors": same_tensors,
        "aliased_buffers": (aliases[1] if aliases else 0) - (aliases_before[1] if aliases_before else 0),
        "params_20": params_20,
    }


def run_without_presync(dev):
    """What plain lazy tracing does (no sync of the inputs first): compile count after each call."""
    import torch_xla

    state, per_step = m.init_state(dev), []
    for i in range(4):
        before = ember_xla.compile_count()
        state, _ = m.train_step(state, m.make_batch(i, dev))
        torch_xla.sync()
        per_step.append(ember_xla.compile_count() - before)
    return per_step


def _hyper_step(state, x):
    """An inject_hyperparams-like step: 0-d float32 hyperparameters in the state, a schedule.

    `b1` and `max_norm` pass through unchanged; `wd` comes back as a computed copy (like
    ember.optim's `_fresh`); `lr` is recomputed from the count by a warmup schedule built from
    `torch.full` constants. The traced code also uses Python numbers equal to `b1` and `wd`
    (0.9, 0.1), which torch_xla turns into device data shared with equal host-uploaded scalars.
    """
    hp = state["hp"]
    count = state["count"]
    warm = torch.full((), 0.01, device=count.device) * torch.minimum(
        count.to(torch.float32) / 3.0, torch.full((), 1.0, device=count.device)
    )
    grad = state["w"] * 0.1 - x
    norm = torch.linalg.vector_norm(grad)
    grad = grad * torch.minimum(hp["max_norm"] / (norm + 1e-6), torch.ones((), device=grad.device))
    mu = state["mu"] * 0.9 + (1 - hp["b1"]) * grad
    w = state["w"] - warm * (mu + hp["wd"] * state["w"])
    new_hp = {"b1": hp["b1"], "wd": hp["wd"] * 1.0, "lr": warm, "max_norm": hp["max_norm"]}
    new = {"w": w, "mu": mu, "count": count + 1, "hp": new_hp}
    return new, {"loss": (w**2).sum(), "lr": warm}


def run_host_scalars(dev):
    """Compiles per call of `_hyper_step` whose 0-d state leaves were uploaded from the host.

    The state is built on the CPU and moved with `.to(dev)` (as `ember.core.device.to_device`
    does): torch_xla turns 0-d tensors equal to 0 or 1 into constants and the others into
    read-only buffers cached by value. At call 6 `wd` (by then a computed buffer) is replaced by a
    new host upload (as `optim.set_hyperparams` does) of 0.9, equal to `b1` and to a constant of
    the step, a buffer-sharing pattern no earlier call had: no recompile either.
    """
    out = {}
    for donate in ("none", "state"):
        state = {
            "w": torch.linspace(-1, 1, 16).reshape(4, 4),
            "mu": torch.zeros(4, 4),
            "count": torch.zeros((), dtype=torch.int64),
            "hp": {"b1": torch.tensor(0.9), "wd": torch.tensor(0.1), "lr": torch.tensor(0.0),
                   "max_norm": torch.tensor(1.0)},
        }
        state = pytree.tree_map(lambda t: t.to(dev), state)
        step = jit(_hyper_step, backend="xla", donate=donate)
        per_step = []
        for i in range(8):
            if i == 5:
                state = {**state, "hp": {**state["hp"], "wd": torch.tensor(0.9).to(dev)}}
            before = step.compile_count
            state, _ = step(state, torch.full((4, 4), 0.5 + i).to(dev))
            per_step.append(step.compile_count - before)
        out[donate] = per_step
    return out


def cpu_input_error(dev):
    """The message jit(backend="xla") gives for a CPU tensor among its arguments."""
    step = jit(m.train_step, backend="xla")
    try:
        step(m.init_state(dev), m.make_batch(0))  # batch left on the CPU
    except ValueError as err:
        return str(err)
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timing-steps", type=int, default=0)
    args = parser.parse_args()
    ember_xla.xla_cpu_devices(int(os.environ.get("CPU_NUM_DEVICES", "1")))
    import torch_xla

    # Start the XLA runtime before the first backward of the process, even a CPU one: autograd
    # sizes its per-device queues when it first runs, and XLA has 0 devices until the runtime starts.
    dev = torch_xla.device()
    eager_losses, eager_state = run_eager()
    out = {"eager_losses": eager_losses}
    out["without_presync_compiles_per_step"] = run_without_presync(dev)
    for donate in ("none", "state"):
        out[donate] = run_xla(donate, dev, args.timing_steps)
    out["cpu_input_error"] = cpu_input_error(dev)
    out["host_scalars_compiles_per_step"] = run_host_scalars(dev)
    out["eager_params_20"] = {k: v.tolist() for k, v in eager_state.params.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
