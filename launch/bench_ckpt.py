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
import shutil
import statistics
import tempfile
import time


def build_state(layers):
    import torch
    from ember import optim
    from ember.core import TrainState, random
    from ember.core.pytree import tree_map
    from ember.models import build_model

    model = build_model("llama3", "125m", n_layers=layers)
    state = TrainState.create(params=model.init(random.key(0)), tx=optim.adamw(1e-4))
    grads = tree_map(lambda p: torch.randn_like(p) * 1e-3, state.params)
    return state.apply_gradients(grads=grads)  # non-zero mu / nu, as in a real run


def methods(state, flat):
    import torch
    import torch.distributed.checkpoint as dcp
    from ember.core.checkpoint import CheckpointManager

    def ember(async_save, checksums=True, compress=False):
        def run(d):
            ckpt = CheckpointManager(d, async_save=async_save, checksums=checksums, compress=compress)
            t0 = time.perf_counter()
            ckpt.save(1, state, force=True)
            t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            ckpt.close()
            return t1 - t0, t2 - t0
        return run

    def torch_save(d):
        t0 = time.perf_counter()
        with open(os.path.join(d, "state.pt"), "wb") as f:
            torch.save(flat, f)
            f.flush()
            os.fsync(f.fileno())
        t = time.perf_counter() - t0
        return t, t

    def dcp_save(d):
        t0 = time.perf_counter()
        dcp.save(flat, checkpoint_id=d, no_dist=True)
        t = time.perf_counter() - t0
        return t, t

    def dcp_async(d):
        t0 = time.perf_counter()
        fut = dcp.async_save(flat, checkpoint_id=d, no_dist=True)
        t1 = time.perf_counter()
        fut.result()
        return t1 - t0, time.perf_counter() - t0

    saves = {"ember sync": ember(False), "ember async": ember(True), "ember async, no CRC": ember(True, False),
             "ember async, zstd": ember(True, compress=True),
             "torch.save": torch_save, "DCP save": dcp_save, "DCP async_save": dcp_async}

    def ember_restore(d):
        with CheckpointManager(d, read_only=True) as ckpt:
            ckpt.restore(like=state)

    def ember_params(d):
        with CheckpointManager(d, read_only=True) as ckpt:
            ckpt.restore_params(like=state.params)

    def dcp_load(d):
        target = {k: torch.empty_like(v) for k, v in flat.items()}
        dcp.load(target, checkpoint_id=d, no_dist=True)

    restores = {"ember restore": ("ember sync", ember_restore), "ember restore_params": ("ember sync", ember_params),
                "ember restore, zstd": ("ember async, zstd", ember_restore),
                "torch.load": ("torch.save", lambda d: torch.load(os.path.join(d, "state.pt"), weights_only=True)),
                "DCP load": ("DCP save", dcp_load)}
    return saves, restores


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

    state = build_state(args.layers)
    flat = {path: x for path, x in tree_leaves_with_path(state) if isinstance(x, torch.Tensor)}
    n_params = sum(x.numel() for _, x in tree_leaves_with_path(state.params))
    mb = sum(x.numel() * x.element_size() for x in flat.values()) / 2**20
    saves, restores = methods(state, flat)
    times = {name: [] for name in [*saves, *restores]}
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    try:
        names = list(saves)
        for r in range(args.repeats):
            dirs = {}
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate: no method always goes first
                fn = saves[name]
                dirs[name] = os.path.join(root, name.replace(" ", "_").replace(",", ""))
                os.makedirs(dirs[name])
                times[name].append(fn(dirs[name]))
            for name, (source, fn) in restores.items():
                t0 = time.perf_counter()
                fn(dirs[source])
                times[name].append((time.perf_counter() - t0,) * 2)
            for d in dirs.values():
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
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
