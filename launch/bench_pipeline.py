"""Pipeline benchmarks: the bubble measured against GPipe's `(S - 1) / (R * M + S - 1)`, and memory per
device by pipeline degree.

    python launch/bench_pipeline.py                         # llama3_tiny's blocks, 2 and 4 stages
    python launch/bench_pipeline.py --markdown BENCHMARKS.md
    python launch/bench_pipeline.py --compile-microbatches 4,16   # compile time of the step by microbatches

Bubble: on one device every stage of an iteration runs one after the other, so an iteration costs one
microbatch through the whole stack and the schedule's `R * M + S - 1` iterations cost `1 / (1 - bubble)`
times the plain stack run on the same `M` microbatches one after another; `1 - plain / pipelined` is the
measured bubble, the schedule's overhead (stages under `vmap`, the shift) included. Each
variant is the forward and backward of `llama3_tiny`'s stacked blocks (eager), timed round-robin in this
process. Memory: parameters plus AdamW state per device from the sharding report (no devices needed), for
`llama3_125m` and Llama-3 8B with stacked blocks at pp = 1, 2, 4.
"""

import argparse
import sys

import torch

from ember import optim
from ember.core import TrainState, random
from ember.core.mesh import Mesh
from ember.core.partition_specs import memory_per_device, sharding_table
from ember.core.partition_specs.pipeline import bubble_fraction, pipeline
from ember.core.pytree import tree_flatten, tree_unflatten
from ember.launch.benchmark import time_round_robin, update_markdown
from ember.launch.benchmark.setup import Variant
from ember.launch.benchmark.timing import percentile
from ember.launch.run_config import get_config as run_config
from ember.models import build_model, get_config

SCHEDULES = [(2, 4), (2, 8), (4, 4), (4, 8)]  # (stages, microbatches)


def bubble_variants(batch: int = 16, seq: int = 64) -> list:
    cfg = run_config("llama3_tiny").model.replace(scan_layers=True, n_layers=8)
    model = build_model("llama3", cfg)
    params = model.init(random.key(0))["blocks"]
    block = model.declare()["blocks"].layer
    positions = torch.arange(seq)
    x = random.normal(random.key(1), (batch, seq, cfg.d_model))

    def timed(run):
        def step():
            leaves, spec = tree_flatten(params)
            leaves = [t.detach().requires_grad_() for t in leaves]
            loss = run(tree_unflatten(leaves, spec)).square().mean()
            torch.autograd.grad(loss, leaves)
            return loss.detach()
        return step

    def plain(p, m):  # the stack on one microbatch after another: the same matmul sizes as the pipeline's
        return torch.cat([model.declare()["blocks"].apply(p, h, positions=positions) for h in x.chunk(m)])

    out = [Variant(f"plain M={m}", timed(lambda p, m=m: plain(p, m)), lambda: 0)
           for m in sorted({m for _, m in SCHEDULES})]
    for stages, microbatches in SCHEDULES:
        def piped(p, s=stages, m=microbatches):
            return pipeline(lambda lp, h: block.apply(lp, h, positions=positions), p, x, stages=s, microbatches=m)
        out.append(Variant(f"S={stages} M={microbatches}", timed(piped), lambda: 0))
    return out


def compile_seconds(microbatches: int, stages: int = 2) -> float:
    """First call minus second of `jit(value_and_grad(loss), backend="inductor")` of `pipeline` over
    `llama3_tiny`'s stacked blocks (4 layers), 2 sequences of 32 tokens a microbatch."""
    import time

    from ember.core import jit, value_and_grad

    cfg = run_config("llama3_tiny").model.replace(scan_layers=True, n_layers=4)
    model = build_model("llama3", cfg)
    params, block = model.init(random.key(0))["blocks"], model.declare()["blocks"].layer
    positions = torch.arange(32)
    x = random.normal(random.key(1), (2 * microbatches, 32, cfg.d_model))

    def loss(p, x):
        return pipeline(lambda lp, h: block.apply(lp, h, positions=positions), p, x, stages=stages,
                        microbatches=microbatches).square().mean()

    step = jit(value_and_grad(loss), backend="inductor")
    times = []
    for _ in range(2):
        start = time.perf_counter()
        step(params, x)
        times.append(time.perf_counter() - start)
    return times[0] - times[1]


def memory_rows(name: str, cfg, pps=(1, 2, 4)) -> list:
    model = build_model("llama3", cfg.replace(scan_layers=True))
    state = TrainState.create(params=model.param_shapes(), tx=optim.adamw(1e-3), key=torch.zeros((), dtype=torch.int64))
    rows = []
    for pp in pps:
        mesh = Mesh.parse(f"pp={pp}", backend="xla") if pp > 1 else Mesh.parse("dp=1", backend="xla")
        rows.append((name, str(mesh), memory_per_device(sharding_table(state, mesh, axes=model.axes)).total / 2**30))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--markdown")
    p.add_argument("--compile-microbatches", help="e.g. 4,16: only time the step's compile at these microbatches")
    args = p.parse_args(argv)
    if args.compile_microbatches:
        for m in [int(m) for m in args.compile_microbatches.split(",")]:
            print(f"{m} microbatches: compile {compile_seconds(m):.1f} s", flush=True)
        return 0
    vs = bubble_variants()
    timed = time_round_robin(vs, warmup=args.warmup, iters=args.iters)
    ms = {v.name: percentile(timed[v.name]["times"], 0.5) for v in vs}
    lines = [f"torch {torch.__version__}, cpu, float32, llama3_tiny's blocks (8 layers), 16 x 64 tokens, eager forward "
             f"and backward, median of {args.iters} round-robin runs (`python launch/bench_pipeline.py`)", "",
             "| schedule | ms | the stack on the same microbatches, ms | 1 - stack / schedule | (S-1)/(M+S-1) |",
             "|---|---|---|---|---|"]
    for stages, microbatches in SCHEDULES:
        s, plain = ms[f"S={stages} M={microbatches}"], ms[f"plain M={microbatches}"]
        lines.append(f"| S={stages} M={microbatches} | {s * 1e3:.1f} | {plain * 1e3:.1f} | {1 - plain / s:.1%} | "
                     f"{bubble_fraction(stages, microbatches):.1%} |")
    mem = memory_rows("llama3_125m", run_config("llama3_125m").model) + memory_rows("llama3/8b",
                                                                                  get_config("llama3", "8b"))
    lines += ["", "| model | mesh | params + AdamW per device |", "|---|---|---|"]
    lines += [f"| {n} | {m} | {g:.3f} GiB |" for n, m, g in mem]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        update_markdown(args.markdown, "## Pipeline\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
