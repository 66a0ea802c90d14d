"""How the training step scales: loss memory with the vocabulary, step memory with the remat policy,
compile time with depth and microbatches.

    python launch/bench_scale.py --loss-memory                  # plain vs chunked LM-head loss, vocab 32K and 128K
    python launch/bench_scale.py --compile-depth 4,12,24        # cold first step of llama3_tiny at 4, 12, 24 layers
    python launch/bench_scale.py --compile-microbatches 1,4,16  # cold first step with 1, 4, 16 microbatches
    python launch/bench_scale.py --remat-memory none,full,dots_saveable --config llama3_125m \
        --batch 4 --seq 512                                     # compiled step's peak memory per remat policy
    python launch/bench_scale.py --scan-steady none,full        # warm step time, unrolled vs scan_layers
    python launch/bench_scale.py --generate 256                 # tokens/s, KV cache vs none, 256 new tokens
    python launch/bench_scale.py --packed-attention 1024        # attention time: unmasked, packed, dense mask
    python launch/bench_scale.py --torch-primitives             # torch's checkpoint / SAC vs ember's remat, compiled
    python launch/bench_scale.py --bridged-checkpointing        # a transformers Llama, with and without checkpointing
    python launch/bench_scale.py --loss-memory --compile-depth 4,12,24 --markdown /tmp/scale.md
    python launch/bench_scale.py --compile-depth 4,24 --scan --baseline 88c41b5  # each row at a commit, then here
    python launch/bench_scale.py --remat-memory none,full --set model.n_layers=2  # a run-config field, every row

Every figure comes from its own fresh process (`--scan-steady` times its two variants side by side
in one process per policy; otherwise an empty Inductor cache for compile times; glibc's
mmap threshold pinned at 64 KiB for memory, so freed tensors leave the resident set), and each
section is reported as ratios to its first row. `--scan` measures the depth section with the blocks
unrolled (`scan_layers=False`) and stacked (the default); `--backend xla` compiles with torch_xla on a
virtual CPU device instead of Inductor.
`--baseline REV` measures every row of the depth, microbatch, remat-memory and scan-steady sections
twice, alternately: with ember as of git revision REV (a temporary worktree put first on
`PYTHONPATH`) and with this tree, so an old and a new path are compared on one machine in one run.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional

TAG = "BENCH_SCALE_RESULT "


@dataclass(frozen=True)
class Tree:
    """Which ember a measurement imports: this tree (`package_root` None) or a baseline worktree."""

    label: str
    script: str
    package_root: Optional[str] = None


TREES: List[Tree] = [Tree("this tree", os.path.abspath(__file__))]


@contextlib.contextmanager
def _baseline_tree(rev):
    """A temporary git worktree at `rev`, importable as `ember` from a folder put first on PYTHONPATH."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="ember_baseline_") as tmp:
        work = os.path.join(tmp, "ember")
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", work, rev], check=True, capture_output=True)
        try:
            short = subprocess.run(["git", "-C", work, "rev-parse", "--short", "HEAD"], check=True,
                                   capture_output=True, text=True).stdout.strip()
            yield Tree(f"baseline {short}", os.path.join(work, "launch", "bench_scale.py"), tmp)
        finally:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", work], capture_output=True)


def _label(tree):
    """The row's leading "path" cell when a baseline is compared, else nothing."""
    return f"| {tree.label} " if len(TREES) > 1 else ""


def _path_header(header, align):
    return (f"| path {header}", f"|---{align}") if len(TREES) > 1 else (header, align)


def _child(spec, tree=None):
    """Run one measurement (`spec`: a dict) in a fresh process, importing `tree`'s ember; return its result."""
    tree = tree or TREES[-1]
    env = dict(os.environ)
    if tree.package_root:
        env["PYTHONPATH"] = os.pathsep.join([tree.package_root, *filter(None, [env.get("PYTHONPATH")])])
    if spec["what"].endswith("memory") or spec["what"] in ("bridged_checkpointing", "torch_primitives"):  # freed tensors leave the resident set (it slows allocation: not for timings)
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    elif spec["what"] == "scan_steady":  # steps timed as train.py runs them: freed memory kept (host_memory.py)
        env.update(MALLOC_MMAP_THRESHOLD_=str(2**31 - 1), MALLOC_TRIM_THRESHOLD_=str(2**31 - 1))
    with tempfile.TemporaryDirectory(prefix="ember_scale_") as cache:
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
        if spec.get("backend") == "xla":
            env.update(PJRT_DEVICE=env.get("PJRT_DEVICE", "CPU"), CPU_NUM_DEVICES="1")
        proc = subprocess.run([sys.executable, tree.script, "--child", json.dumps(spec)],
                              env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    raise RuntimeError(f"measurement {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _ratio(value, base):
    """`value / base` as "0.39x"; "n/a" when the baseline measured nothing (a tiny shape below RSS resolution)."""
    return f"{value / base:.2f}x" if base > 0 else "n/a"


def _set_overrides(pairs):
    """`--set KEY=VALUE` pairs as run-config overrides ("true" / "false" become booleans)."""
    overrides = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE (a run-config field, e.g. model.n_layers=2), got {pair!r}")
        overrides[key] = {"true": True, "false": False}.get(value.lower(), value)
    return overrides


def _shape_overrides(args):
    return {**args.overrides, **({"data.batch_size": args.batch} if args.batch else {}),
            **({"data.seq_len": args.seq} if args.seq else {})}


def remat_memory(args):
    rows = list(_path_header("| remat | scan_layers | transient MiB | vs first row | loss |", "|---|---|---:|---:|---:|"))
    first = {}
    for scan in ([False, True] if args.scan else [True]):
        for policy in args.remat_memory.split(","):
            overrides = {"model.remat": policy, "model.scan_layers": scan, **_shape_overrides(args)}
            for tree in TREES:
                r = _child(dict(what="step_memory", config=args.config, overrides=overrides), tree)
                base = first.setdefault(tree, r["transient_bytes"])
                rows.append(f"{_label(tree)}| {policy} | {scan} | {r['transient_bytes'] / 2**20:,.0f} | "
                            f"{_ratio(r['transient_bytes'], base)} | {r['loss']:.6f} |")
                print(rows[-1], flush=True)
    shape = ", ".join(f"{k} {v}" for k, v in _shape_overrides(args).items())
    return (f"Peak transient memory of the compiled train step of `{args.config}` ({shape or 'preset shape'}; "
            "Inductor, AdamW, state donated; gradients included):", rows)


def scan_steady(args):
    rows = list(_path_header("| remat | unrolled step (ms) | scan_layers step (ms) | scan vs unrolled | same loss |",
                             "|---|---:|---:|---:|---|"))
    for policy in args.scan_steady.split(","):
        variants = {str(scan): {"model.remat": policy, "model.scan_layers": scan, **_shape_overrides(args)}
                    for scan in (False, True)}
        for tree in TREES:
            r = _child(dict(what="scan_steady", config=args.config, variants=variants), tree)
            plain, scan = r["False"], r["True"]
            rows.append(f"{_label(tree)}| {policy} | {plain['step_s'] * 1e3:.1f} | {scan['step_s'] * 1e3:.1f} | "
                        f"{_ratio(scan['step_s'], plain['step_s'])} | {plain['loss'] == scan['loss']} |")
            print(rows[-1], flush=True)
    return (f"Warm compiled step of `{args.config}` (Inductor, AdamW, state donated), unrolled vs "
            "scan_layers, both in one process, timed alternately (median of 5 rounds of 5 calls), "
            "freed memory kept as train.py keeps it:", rows)


def generate_speed(args):
    r = _child(dict(what="generate", config=args.config, overrides=args.overrides, new_tokens=args.generate))
    base = r["uncached"]["tokens_per_s"]
    rows = ["| generation | tokens/s | vs uncached | same tokens |", "|---|---:|---:|---|"]
    for name, label in (("uncached", "no cache (eager, whole prefix per token)"), ("cached_eager", "KV cache, eager"),
                        ("cached_inductor", "KV cache, compiled decode step")):
        rows.append(f"| {label} | {r[name]['tokens_per_s']:,.0f} | {_ratio(r[name]['tokens_per_s'], base)} | "
                    f"{r[name]['same_tokens']} |")
        print(rows[-1], flush=True)
    return (f"Greedy generation of {args.generate} tokens after a 16-token prompt, `{args.config}`'s model, batch 1 "
            "(warm: compiling not counted):", rows)


def packed_attention(args):
    r = _child(dict(what="packed_attention", seq_len=args.packed_attention, overrides=args.overrides))
    rows = ["| attention | fwd + bwd (ms) | vs unmasked |", "|---|---:|---:|"]
    for name, label in (("unmasked", "unmasked (causal)"), ("packed", "packed: segment mask through SDPA"),
                        ("packed_one_call", "packed, the mask in one SDPA call"),
                        ("dense", "dense fallback: scores, softmax, @ v")):
        rows.append(f"| {label} | {r[name] * 1e3:.1f} | {_ratio(r[name], r['unmasked'])} |")
        print(rows[-1], flush=True)
    for name, label in (("step_unmasked", "llama3_tiny train step, plain windows"),
                        ("step_packed", "llama3_tiny train step, packed documents")):
        rows.append(f"| {label} | {r[name] * 1e3:.1f} | {_ratio(r[name], r['step_unmasked'])} |")
        print(rows[-1], flush=True)
    return (f"Compiled attention forward + backward at seq {args.packed_attention} (batch 2, 8 heads of 64, "
            "4 documents a row; Inductor, median of 5), and the compiled train step at that length (batch 2; "
            "ratio to the plain step):", rows)


def loss_memory(args):
    rows = ["| vocab | loss | transient MiB | vs plain | whole fp32 logits MiB |", "|---:|---|---:|---:|---:|"]
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        plain = None
        for variant in ("plain", "chunked"):
            r = _child(dict(what="loss_memory", variant=variant, vocab=vocab, tokens=args.tokens,
                            d_model=args.d_model, chunk_size=args.chunk_size))
            plain = r["transient_bytes"] if plain is None else plain
            name = "plain" if variant == "plain" else f"chunked ({args.chunk_size} tokens)"
            rows.append(f"| {vocab:,} | {name} | {r['transient_bytes'] / 2**20:,.0f} | "
                        f"{_ratio(r['transient_bytes'], plain)} | {r['logits_bytes'] / 2**20:,.0f} |")
            print(rows[-1], flush=True)
    return (f"Loss + gradient w.r.t. hidden states and head weight, compiled (Inductor), {args.tokens} tokens, "
            f"d_model {args.d_model}:", rows)


def torch_primitives(args):
    from ember.launch.benchmark.primitives import PRIMITIVES

    rows = ["| loop | remat | cold first call (s) | warm step (s) | transient MiB | vs unrolled, none | "
            "max grad error |", "|---|---|---:|---:|---:|---:|---:|"]
    base = None
    for variant in (args.torch_primitives.split(",") if args.torch_primitives != "all" else PRIMITIVES):
        try:
            r = _child(dict(what="torch_primitives", variant=variant))
        except RuntimeError as err:
            rows.append(f"| {' | '.join(variant.split('-'))} | fails: {str(err).splitlines()[-1][:120]} | | | | |")
            print(rows[-1], flush=True)
            continue
        base = r["transient_bytes"] if base is None else base
        rows.append(f"| {' | '.join(variant.split('-'))} | {r['first_call_s']:.1f} | {r['step_s']:.2f} | "
                    f"{r['transient_bytes'] / 2**20:,.0f} | {_ratio(r['transient_bytes'], base)} | "
                    f"{r['grad_error']:.1e} |")
        print(rows[-1], flush=True)
    return ("8 residual MLP blocks (256 -> 1024 -> 256, batch 4096, fp32), value_and_grad compiled by "
            "`ember.core.jit` (Inductor); gradient error against the eager unrolled loop:", rows)


def bridged_checkpointing(args):
    shape = dict(layers=args.hf_layers, hidden=args.hf_hidden, batch=args.batch or 4, seq=args.seq or 512)
    rows = ["| gradient_checkpointing_enable() | transient MiB | vs off | compiled losses | eager losses |",
            "|---|---:|---:|---|---|"]
    off = None
    for checkpointing in (False, True):
        r = _child(dict(what="bridged_checkpointing", checkpointing=checkpointing, shape=shape))
        off = r["transient_bytes"] if off is None else off
        rows.append(f"| {checkpointing} | {r['transient_bytes'] / 2**20:,.0f} | {_ratio(r['transient_bytes'], off)} | "
                    f"{', '.join(f'{x:.6f}' for x in r['compiled_losses'])} | "
                    f"{', '.join(f'{x:.6f}' for x in r['eager_losses'])} |")
        print(rows[-1], flush=True)
    return (f"A transformers `LlamaForCausalLM` ({shape['layers']} layers, hidden {shape['hidden']}) bridged with "
            f"`from_torch`, `jit(train_step(...), backend=\"inductor\")`, AdamW, batch {shape['batch']} x "
            f"{shape['seq']} tokens: peak transient memory of the compiled step, and 3 steps' losses compiled "
            "and eager:", rows)


def compile_scaling(args, field, values, label):
    rows = list(_path_header(
        f"| {label} | scan_layers | first step (s) | vs first row | second step (s) | compile (s) | vs first row |",
        "|---:|---|---:|---:|---:|---:|---:|"))
    first = {}
    both = args.scan and field == "model.n_layers"
    for scan in ([False, True] if both else [True]):
        for v in values:
            overrides = {**args.overrides, field: v, "model.remat": args.remat,
                         **({"model.scan_layers": scan} if both else {})}
            if field == "microbatches":
                overrides["data.batch_size"] = max(values)
            for tree in TREES:
                r = _child(dict(what="compile", config=args.config, backend=args.backend, overrides=overrides), tree)
                compile_s = r["first_call_s"] - r["warm_call_s"]
                base = first.setdefault((tree, scan), (r["first_call_s"], compile_s))
                scanned = overrides.get("model.scan_layers", scan)  # `--set model.scan_layers=False` too
                rows.append(f"{_label(tree)}| {v} | {scanned} | {r['first_call_s']:.1f} | {_ratio(r['first_call_s'], base[0])} | "
                            f"{r['warm_call_s']:.2f} | {compile_s:.1f} | {_ratio(compile_s, base[1])} |")
                print(rows[-1], flush=True)
    return (f"Cold first step of `{args.config}` ({args.backend}, remat {args.remat}), empty compile cache; "
            "compile = first step - second step; ratios to the first row of the same path and scan_layers:", rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss-memory", action="store_true", help="plain vs chunked loss memory at vocab 32K and 128K")
    p.add_argument("--vocabs", default="32768,131072", help="comma-separated vocabulary sizes for --loss-memory")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the loss-memory batch")
    p.add_argument("--d-model", type=int, default=256, help="hidden width in the loss-memory measurement")
    p.add_argument("--chunk-size", type=int, default=512, help="tokens per chunk of the chunked loss")
    p.add_argument("--compile-depth", help="comma-separated n_layers for cold compile times")
    p.add_argument("--compile-microbatches", help="comma-separated microbatch counts for cold compile times")
    p.add_argument("--remat-memory", help="comma-separated remat policies: the compiled step's peak memory for each")
    p.add_argument("--scan-steady", help="comma-separated remat policies: warm step time, unrolled vs scan_layers")
    p.add_argument("--generate", type=int, metavar="N", help="tokens/s generating N tokens, KV cache vs none")
    p.add_argument("--packed-attention", type=int, metavar="T", help="attention time at seq T: unmasked, packed, dense")
    p.add_argument("--torch-primitives", nargs="?", const="all",
                   help="torch's checkpoint / SAC against ember's remat inside the compiled step (comma-separated variants)")
    p.add_argument("--bridged-checkpointing", action="store_true",
                   help="a bridged transformers Llama's compiled step memory with and without checkpointing")
    p.add_argument("--hf-layers", type=int, default=4, help="layers of the --bridged-checkpointing model")
    p.add_argument("--hf-hidden", type=int, default=256, help="hidden size of the --bridged-checkpointing model")
    p.add_argument("--baseline", metavar="REV", help="also measure every row with ember at git revision REV")
    p.add_argument("--batch", type=int, help="batch size override for --remat-memory / --scan-steady")
    p.add_argument("--seq", type=int, help="sequence length override for --remat-memory / --scan-steady")
    p.add_argument("--scan", action="store_true",
                   help="measure --compile-depth and --remat-memory with scan_layers False and True")
    p.add_argument("--remat", default="none", help="remat policy of the model in the compile-time rows")
    p.add_argument("--config", default="llama3_tiny", help="registered run config for compile times")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a run-config override for every row of --config (repeatable), e.g. --set model.n_layers=2")
    p.add_argument("--backend", choices=["inductor", "xla"], default="inductor")
    p.add_argument("--markdown", help="also write the tables to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.overrides = _set_overrides(args.set)
    except ValueError as err:
        p.error(str(err))
    if args.child:
        from ember.launch.benchmark.scale_child import run_child  # the measurement, in this fresh process

        print(TAG + json.dumps(run_child(json.loads(args.child))), flush=True)
        return None
    import torch

    with (_baseline_tree(args.baseline) if args.baseline else contextlib.nullcontext()) as baseline:
        if baseline is not None:
            TREES.insert(0, baseline)
        return _measure(p, args, torch)


def _measure(p, args, torch):
    sections = []
    if args.torch_primitives:
        sections.append(torch_primitives(args))
    if args.bridged_checkpointing:
        sections.append(bridged_checkpointing(args))
    if args.loss_memory:
        sections.append(loss_memory(args))
    if args.remat_memory:
        sections.append(remat_memory(args))
    if args.scan_steady:
        sections.append(scan_steady(args))
    if args.generate:
        sections.append(generate_speed(args))
    if args.packed_attention:
        sections.append(packed_attention(args))
    if args.compile_depth:
        sections.append(compile_scaling(args, "model.n_layers", [int(x) for x in args.compile_depth.split(",")],
                                        "layers"))
    if args.compile_microbatches:
        sections.append(compile_scaling(args, "microbatches", [int(x) for x in args.compile_microbatches.split(",")],
                                        "microbatches"))
    if not sections:
        p.error("choose at least one of --torch-primitives, --bridged-checkpointing, --loss-memory, --remat-memory, "
                "--scan-steady, --generate, --packed-attention, --compile-depth, --compile-microbatches")
    against = f" Paths: {', '.join(t.label for t in TREES)}." if len(TREES) > 1 else ""
    text = f"torch {torch.__version__}, {os.cpu_count()} CPU cores.{against}\n\n" + "\n\n".join(
        title + "\n\n" + "\n".join(rows) for title, rows in sections)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return sections


if __name__ == "__main__":
    main()
