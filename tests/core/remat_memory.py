"""Measure peak memory of one gradient step through a deep MLP stack, with and without `remat`.

Run: `python tests/core/remat_memory.py [--json]` (two preset shapes), or one custom shape with
`python tests/core/remat_memory.py --blocks 16 --width 1024 --hidden 4096 --batch 256`.

Each variant runs in a fresh process (so one variant's freed memory cannot hide the other's peak)
with glibc's mmap threshold pinned at 64 KiB, so every large tensor is its own mapping and the
resident set follows live tensor memory instead of allocator caching. One warm-up step pages in
kernel code and fills one-time caches; then the kernel's RSS high-water mark is reset
(`/proc/self/clear_refs`; where that is refused, `ru_maxrss` of the whole run is used) and the
second step is measured: peak RSS minus RSS just before it. That includes the gradients (the same
in both variants) and everything kept alive for backward (what remat saves). `--autograd` adds
the same two models differentiated by `torch.autograd.grad` instead of `torch.func`; `--jit` adds
the step compiled whole by `ember.core.jit` (Inductor), plain, remat "full" and "dots_saveable".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

MIB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _child(variant: str, blocks: int, width: int, hidden: int, batch: int) -> dict:
    import gc

    import torch

    from ember.core.jit import jit
    from ember.core.transforms import remat, value_and_grad

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    def block(p, x):
        return x + torch.nn.functional.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]

    mode, _, how = variant.partition("-")
    blk = {"plain": block, "remat": remat(block), "dots": remat(block, policy="dots_saveable")}[mode]

    def loss(params, x):
        for p in params:
            x = blk(p, x)
        return x.square().mean()

    g = torch.Generator().manual_seed(0)
    params = [
        {
            "w1": torch.randn(width, hidden, generator=g) / width**0.5,
            "b1": torch.zeros(hidden),
            "w2": torch.randn(hidden, width, generator=g) / hidden**0.5,
        }
        for _ in range(blocks)
    ]
    x = torch.randn(batch, width, generator=g)
    step = value_and_grad(loss)
    if how == "autograd":

        def step(params, x):
            leaves = [{k: t.detach().requires_grad_() for k, t in p.items()} for p in params]
            value = loss(leaves, x)
            grads = torch.autograd.grad(value, [t for p in leaves for t in p.values()])
            return value.detach(), [
                dict(zip(p.keys(), grads[3 * i : 3 * i + 3])) for i, p in enumerate(leaves)
            ]

    if how == "jit":
        step = jit(value_and_grad(loss), backend="inductor")
    # Warm-up: the first step pages in kernel code and fills one-time caches (tens of MiB of
    # RSS that is not activation memory); then reset the high-water mark and measure step 2.
    value, grads = step(params, x)
    del value, grads
    gc.collect()
    warm = _reset_peak()
    before = _status_kib("VmRSS")
    value, grads = step(params, x)
    peak = _status_kib("VmHWM") if warm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grad_bytes = sum(t.numel() * t.element_size() for p in grads for t in p.values())
    return {
        "variant": variant,
        "peak_mib": (peak - before) / 1024,
        "grads_mib": grad_bytes / MIB,
        "warm": warm,
        "loss": float(value),  # host sync: a measuring script, outside any step
    }


def measure(variant: str, *, blocks: int, width: int, hidden: int, batch: int) -> dict:
    """Run one variant of `VARIANTS` in a fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    args = [sys.executable, __file__, "--child", variant, "--blocks", str(blocks), "--width",
            str(width), "--hidden", str(hidden), "--batch", str(batch)]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {variant} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


VARIANTS = ["plain", "remat", "plain-autograd", "remat-autograd", "plain-jit", "remat-jit", "dots-jit"]
PRESETS = {
    # The shape from the task: weights dominate (16 x 32 MiB), activations are small per block.
    "weights-heavy": dict(blocks=16, width=1024, hidden=4096, batch=256),
    # Many tokens per weight, as in LM training: activations dominate.
    "activations-heavy": dict(blocks=16, width=256, hidden=1024, batch=2048),
}


def _table(name: str, shape: dict, rows: dict) -> None:
    act = shape["batch"] * shape["hidden"] * 4 / MIB  # one (batch, hidden) fp32 activation
    print(f"{name}: {shape['blocks']} blocks, width {shape['width']}, hidden {shape['hidden']}, "
          f"batch {shape['batch']}, fp32, CPU")  # fmt: skip
    grads = rows["plain"]["grads_mib"]
    print(f"  one (batch, hidden) activation = {act:.1f} MiB; gradients = {grads:.0f} MiB")
    print(f"  {'variant':<15} {'peak - before (MiB)':>20} {'minus grads (MiB)':>18} {'loss':>12}")
    for v, r in rows.items():
        peak, rest = r["peak_mib"], r["peak_mib"] - r["grads_mib"]
        print(f"  {v:<15} {peak:>20.1f} {rest:>18.1f} {r['loss']:>12.6f}")
    print(f"  remat / plain peak: {rows['remat']['peak_mib'] / rows['plain']['peak_mib']:.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, help="with any shape flag, run one custom shape")
    ap.add_argument("--width", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--autograd", action="store_true", help="also measure torch.autograd.grad")
    ap.add_argument("--jit", action="store_true", help="also measure the step compiled by ember.core.jit")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    given = {k: getattr(a, k) for k in ("blocks", "width", "hidden", "batch") if getattr(a, k)}
    if a.child:
        print(json.dumps(_child(a.child, **given)))
        return
    shapes = {"custom": {**PRESETS["weights-heavy"], **given}} if given else PRESETS
    chosen = VARIANTS[:2] + (VARIANTS[2:4] if a.autograd else []) + (VARIANTS[4:] if a.jit else [])
    results = {name: {v: measure(v, **shape) for v in chosen} for name, shape in shapes.items()}
    if a.json:
        print(json.dumps(results))
        return
    for name, rows in results.items():
        _table(name, shapes[name], rows)


if __name__ == "__main__":
    main()
