"""Checkpoint save / restore time for a ~100M-parameter training state: ember vs torch.save vs DCP.

    python launch/bench_ckpt.py                          # llama3 125m shapes with 9 layers (~103M params)
    python launch/bench_ckpt.py --layers 2 --repeats 2   # quick
    python launch/bench_ckpt.py --markdown /work/notes/bench_ckpt.md

The state is a `TrainState` (params + AdamW mu / nu after one update, fp32: about 12 bytes per
parameter). Every method runs in this process, round-robin (the order rotates every repeat),
`--repeats` times; the table gives medians. "blocking" is how long training waits; "committed" is until the files are durable
(orbax and DCP fsync their files; torch.save is followed by an fsync for parity). Restores read
files just written, so they come from the page cache.
"""

import argparse
import os
import statistics
import tempfile


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=9, help="llama3 125m layers (9: ~103M parameters)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written (deleted after)")
    p.add_argument("--markdown", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint")
    from ember.core.pytree import tree_leaves_with_path
    from ember.launch.benchmark.checkpoints import build_state, methods, time_methods

    state = build_state(args.layers)
    flat = {path: x for path, x in tree_leaves_with_path(state) if isinstance(x, torch.Tensor)}
    n_params = sum(x.numel() for _, x in tree_leaves_with_path(state.params))
    mb = sum(x.numel() * x.element_size() for x in flat.values()) / 2**20
    saves, restores = methods(state, flat)
    times = time_methods(saves, restores, repeats=args.repeats, directory=args.dir)
    lines = [f"State: llama3 125m shapes, {args.layers} layers, {n_params / 1e6:.1f}M params; TrainState with AdamW "
             f"mu/nu = {mb:,.0f} MiB fp32. CPU: {os.cpu_count()} cores, torch {torch.__version__}; median of "
             f"{args.repeats}.", "",
             "| method | blocking (s) | committed (s) | min-max committed (s) | MiB/s (committed) |",
             "|---|---:|---:|---:|---:|"]
    for name, ts in times.items():
        block, done = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        spread = f"{min(t[1] for t in ts):.2f}-{max(t[1] for t in ts):.2f}"
        lines.append(f"| {name} | {block:.2f} | {done:.2f} | {spread} | {mb / done:,.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("# Checkpoint benchmark (launch/bench_ckpt.py)\n\n" + table + "\n")
    return times


if __name__ == "__main__":
    main()
