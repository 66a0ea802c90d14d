"""`scan` rolled against unrolled in ember's Inductor step: compile time by length, and the warm step.

    python launch/bench_scan.py                         # lengths 4 and 24, width 64
    python launch/bench_scan.py --lengths 4,24,96 --width 256 --markdown BENCHMARKS.md

Each variant is `jit(value_and_grad(loss))` of a residual MLP stack scanned over its stacked parameters,
`scan(...)` (rolled: one `while_loop` each way) or `scan(..., unroll=True)` (every step in the graph), in
one process with an empty Inductor cache. First call = trace + compile + one step; the warm step is the
median of `--calls` calls, the variants taken in turn. Ratios: each length's first call to the shortest's,
and the rolled warm step to the unrolled one.
"""

import argparse
import os
import statistics
import tempfile
import time


def _loss(unroll):
    import torch

    from ember.core.transforms import scan

    def block(h, p):
        return h + torch.tanh(h @ p["w1"]) @ p["w2"], None

    def loss(params, h0):
        h, _ = scan(block, h0, params, unroll=unroll)
        return h.pow(2).mean()

    return loss


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4,24")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--markdown", help="append the table to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench_scan_"))
    import torch

    from ember.core import jit
    from ember.core.transforms import value_and_grad

    torch.set_num_threads(1)
    lengths = [int(n) for n in args.lengths.split(",")]
    first, steady = {}, {}
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        params = {"w1": torch.randn(n, args.width, 2 * args.width, generator=g) / args.width ** 0.5,
                  "w2": torch.randn(n, 2 * args.width, args.width, generator=g) / (2 * args.width) ** 0.5}
        h0 = torch.randn(args.batch, args.width, generator=g)
        steps = {name: jit(value_and_grad(_loss(unroll))) for name, unroll in (("rolled", 1), ("unrolled", True))}
        for name, step in steps.items():
            start = time.perf_counter()
            step(params, h0)
            first[name, n] = time.perf_counter() - start
        times = {name: [] for name in steps}
        for _ in range(args.calls):
            for name, step in steps.items():
                start = time.perf_counter()
                step(params, h0)
                times[name].append(time.perf_counter() - start)
        steady.update({(name, n): statistics.median(t) for name, t in times.items()})
    rows = [f"`python launch/bench_scan.py --lengths {args.lengths} --width {args.width}` (torch {torch.__version__}, "
            "1 thread, empty Inductor cache):", "",
            "| length | rolled first call (s) | vs shortest | unrolled first call (s) | vs shortest "
            "| rolled warm step (ms) | unrolled warm step (ms) | rolled vs unrolled |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in lengths:
        rows.append(f"| {n} | {first['rolled', n]:.1f} | {first['rolled', n] / first['rolled', lengths[0]]:.2f}x "
                    f"| {first['unrolled', n]:.1f} | {first['unrolled', n] / first['unrolled', lengths[0]]:.2f}x "
                    f"| {steady['rolled', n] * 1e3:.2f} | {steady['unrolled', n] * 1e3:.2f} "
                    f"| {steady['rolled', n] / steady['unrolled', n]:.2f}x |")
    text = "\n".join(rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
