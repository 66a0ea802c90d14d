"""Context parallelism's memory: the transient memory per process of a train step at cp = 1, 2, 4, and the
longest sequence a device of a given memory trains with and without `cp`.

    python launch/bench_context.py                            # llama3_125m, --seq 1024,2048,3072 --cp 1,2,4
    python launch/bench_context.py --budget-gib 80 --markdown BENCHMARKS.md
    python launch/bench_context.py --attention                # attention's own cost of not keeping its mask

Each `cp` runs as that many processes over gloo (DTensor, the ready-made layout of `--mesh cp=N`; `cp=1` is one
plain process), every one training `--model` eagerly with AdamW on one sequence put in `cp`'s head-tail order.
Per process: the RSS held between steps (parameters, AdamW state, torch itself) and the transient at peak of
one forward and backward after a warm one (the activations kept for the backward and the gradients; the
optimizer's update peaks apart, by the parameters' size whatever the sequence), `VmHWM` reset and
`MALLOC_MMAP_THRESHOLD_` pinned so freed tensors leave RSS, as in `launch/bench_scale.py --remat-memory`.
Three lengths or more fit `transient = c + a T + b T^2` per cp (`c`: the gradients); the longest sequence
is the largest `T` (a multiple of `2 cp`) with `held + c + a T + b T^2` within `--budget-gib`.
"""

import argparse
import functools
import json
import math
import os
import sys
import tempfile

import numpy as np
import torch

MMAP_THRESHOLD = str(64 * 1024)


def _measure(seq: int, cp: int, model_name: str) -> dict:
    from ember import optim
    from ember.core import TrainState, random
    from ember.core.transforms import grad
    from ember.core.step_fns import train_step
    from ember.data import ContextOrder
    from ember.launch.benchmark.children import memory_peak, rss_bytes
    from ember.launch.run_config import get_config as run_config
    from ember.models import build_model, lm_loss

    cfg = run_config(model_name).model
    model = build_model("llama3", cfg.replace(max_seq_len=max(seq, cfg.max_seq_len)))
    tx = optim.adamw(1e-4)
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))
    tokens = random.randint(random.key(2), (1, seq + 1), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss_fn = lm_loss(model)
    step = train_step(loss_fn, tx)

    def forward_backward(s, batch):  # what the sequence's length and cp change: the activations kept for backward
        return grad(lambda p: loss_fn(p, batch, key=None)[0].mean())(s.params)

    if cp == 1:
        run = lambda s, fn=step: fn(s, batch)  # noqa: E731
    else:
        from ember.core.mesh import Mesh
        from ember.core.partition_specs import Sharding, for_mesh, shard, shard_batch, use_sharding

        mesh = Mesh.parse(f"cp={cp}", devices=cp, backend="dtensor")
        sharding = Sharding(mesh, for_mesh(mesh.names))
        ordered = ContextOrder(cp)({k: v.numpy() for k, v in batch.items()})
        batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ordered.items()}
        state = shard(state, sharding, axes=model.axes)

        def run(s, fn=step):
            with use_sharding(sharding):
                return fn(s, shard_batch(batch, sharding))
    state, _ = run(state)  # warm: the optimizer state exists from here on
    run(state, forward_backward)
    held = rss_bytes()
    base, peak = memory_peak(lambda: run(state, forward_backward), cuda=False)
    return {"held": held, "transient": peak - base}


def _rank(rank: int, cp: int, seq: int, model_name: str, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
    if cp > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), cp), rank=rank,
                                world_size=cp)
    try:
        result = _measure(seq, cp, model_name)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        if cp > 1:
            dist.destroy_process_group()


def measure(seq: int, cp: int, model_name: str) -> dict:
    """The largest `held` and `transient` bytes over the `cp` processes of one run."""
    import torch.multiprocessing as mp

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the gloo ranks run on the CPU, a GPU host too
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # read by each spawned process's allocator at its start
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(cp, seq, model_name, out), nprocs=cp, start_method="spawn")
        results = []
        for r in range(cp):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
    return {k: max(r[k] for r in results) for k in ("held", "transient")}


def attention_cost(seq: int, cp: int, heads: int, head_dim: int, iters: int = 7) -> dict:
    """One process's attention under `cp` (its queries against every key, the mask from the head-tail order),
    forward and backward, as built (rematerialised: the backward builds the mask and runs the forward again)
    and with both kept, side by side in this process: median seconds of `iters` each, and the largest
    difference of their gradients."""
    import statistics
    import time

    from ember.core.partition_specs.context_parallel import head_tail_order
    from ember.core.remat import remat
    from ember.core.transforms import grad
    from ember.models.layers.attention import _attend_by_index

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=g) for n in (seq // cp, seq, seq))
    order = torch.tensor(head_tail_order(seq, cp))
    queries, keys = {"index": order[: seq // cp][None]}, {"index": order[None]}
    attend = functools.partial(_attend_by_index, causal=True, window=None, scale=None, n_rep=1)  # the model's
    runs = {name: grad(lambda q, k, v, fn=fn: fn(q, k, v, queries, keys).square().sum(), argnums=(0, 1, 2))
            for name, fn in (("kept", attend), ("remat", remat(attend)))}
    grads = {name: run(q, k, v) for name, run in runs.items()}  # warm
    times = {name: [] for name in runs}
    for _ in range(iters):
        for name, run in runs.items():  # round-robin: both see the same machine
            start = time.perf_counter()
            run(q, k, v)
            times[name].append(time.perf_counter() - start)
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["kept"], grads["remat"]))
    return {**{name: statistics.median(t) for name, t in times.items()}, "grad_diff": diff}


def longest_sequence(held: float, a: float, b: float, budget: float, multiple: int) -> int:
    """The largest multiple of `multiple` with `held + a T + b T^2 <= budget` (0 when none); `b <= 0`: linear
    (memory does not shrink with length: a fit bending down is measurement noise)."""
    room = budget - held
    if room <= 0:
        return 0
    t = room / a if b <= 0 else (-a + math.sqrt(a * a + 4 * b * room)) / (2 * b)
    return int(t // multiple) * multiple


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3_125m", help="a run preset of the Llama family")
    p.add_argument("--seq", default="1024,2048,3072", help="three or more lengths, each a multiple of 2 x every cp")
    p.add_argument("--cp", default="1,2,4")
    p.add_argument("--budget-gib", type=float, default=80.0, help="one device's memory (80: an H100)")
    p.add_argument("--attention", action="store_true",
                   help="instead: time one layer's attention under each cp > 1, rematerialised (as built) vs kept")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    seqs, cps = [int(s) for s in args.seq.split(",")], [int(c) for c in args.cp.split(",")]
    if args.attention:
        return _attention_table(args.model, seqs, [c for c in cps if c > 1])
    if len(seqs) < 3:
        p.error(f"--seq takes three lengths or more (the fit has three terms); got {args.seq}")
    lines = [f"torch {torch.__version__}, cpu, float32, {args.model}, batch 1, AdamW, eager, DTensor over gloo "
             f"(`python launch/bench_context.py --seq {args.seq} --cp {args.cp} --budget-gib {args.budget_gib:g}`)",
             "", "| cp | T | held per process, GiB | transient per process, GiB | transient vs cp=1 |", "|---|---|---|---|---|"]
    fits, one = [], None
    for cp in cps:
        got = {t: measure(t, cp, args.model) for t in seqs}
        one = got if cp == 1 else one
        for t in seqs:
            ratio = f"{got[t]['transient'] / one[t]['transient']:.2f}x" if one else "-"
            lines.append(f"| {cp} | {t} | {got[t]['held'] / 2**30:.3f} | {got[t]['transient'] / 2**30:.3f} | {ratio} |")
            print(lines[-1], flush=True)
        b, a, c = np.polyfit(seqs, [got[t]["transient"] for t in seqs], 2)
        held = max(got[t]["held"] for t in seqs)
        fits.append((cp, c, a, b, longest_sequence(held + c, a, b, args.budget_gib * 2**30, 2 * cp)))
    lines += ["", f"| cp | c: GiB | a: bytes per token | b: bytes per token^2 | longest sequence within "
              f"{args.budget_gib:g} GiB |", "|---|---|---|---|---|"]
    lines += [f"| {cp} | {c / 2**30:.3f} | {a:,.0f} | {b:,.2f} | {t:,} |" for cp, c, a, b, t in fits]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        from ember.launch.benchmark import update_markdown

        update_markdown(args.markdown, "## Context parallelism: memory per process\n\n" + text)
    return 0


def _attention_table(model_name: str, seqs, cps) -> int:
    from ember.launch.run_config import get_config as run_config

    cfg = run_config(model_name).model
    heads, head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
    print(f"torch {torch.__version__}, cpu, float32, {model_name}'s attention ({heads} heads of {head_dim}), batch 1, "
          f"forward and backward, median of 7 (`python launch/bench_context.py --attention`)\n\n"
          f"| cp | T | kept, ms | rematerialised, ms | ratio |\n|---|---|---|---|---|")
    for cp in cps:
        for t in seqs:
            got = attention_cost(t, cp, heads, head_dim)
            kept, again = got["kept"] * 1e3, got["remat"] * 1e3
            print(f"| {cp} | {t} | {kept:.1f} | {again:.1f} | {again / kept:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
