"""Mixture-of-experts benchmarks: the MoE step against a dense model of the same active parameters,
the dispatch variants against each other, and memory per device by expert-parallel degree.

    python launch/bench_moe.py                                  # qwen3_moe_tiny, float32, timings + memory
    python launch/bench_moe.py --dtype bfloat16 --iters 50      # on a GPU: bf16 compute, MFU on active params
    python launch/bench_moe.py --markdown BENCHMARKS.md         # replace the "Mixture of experts" section
    python launch/bench_moe.py --model.d_model 512 --model.moe_ffn_dim 256   # any run-config override
    python launch/bench_moe.py --data.batch_size 128 --microbatches 8        # 16,384 tokens an optimizer step

Timings: every variant is the same run config's model compiled by `jit(backend="inductor")`,
trained with AdamW on one batch, timed round-robin in this process after warm-up
(`ember.launch.benchmark.time_round_robin`), reported as tokens/s and as a ratio to the dense
model whose SwiGLU width is `experts_per_token * moe_ffn_dim` (the same parameters per token).
Memory: parameters plus AdamW state per device from the sharding report (no devices needed), for
the tiny config and for Qwen3-30B-A3B, at `fsdp=8` with ep = 1, 2, 4.
"""

import argparse
import json
import sys

import torch

from ember import optim
from ember.core import TrainState, pytree, random, to_device
from ember.core.compat.grouped_mm import grouped_mm, grouped_mm_row_alignment, grouped_mm_runs
from ember.core.jit import jit
from ember.core.mesh import Mesh
from ember.core.partition_specs import MESH_ORDER, memory_per_device, sharding_table
from ember.core.step_fns import train_step
from ember.core.tree_math import tree_cast
from ember.launch.benchmark import time_round_robin, update_markdown
from ember.launch.benchmark.setup import Variant, sync
from ember.launch.benchmark.timing import matmul_peak, percentile
from ember.launch.run_config import parse_cli
from ember.models import build_model, count_active_params, count_params, get_config, lm_loss
from ember.models.layers import initializers as inits
from ember.models.layers.moe import DROPLESS
from ember.models.layers.moe_grouped import grouped_swiglu, sort_pairs

LAYER_TOKENS = 4096
DISPATCH = {"dropless grouped": (None, "grouped"), "dropless padded": (None, "padded"),
            "capacity 1.25": (1.25, "grouped"), "capacity 1.0": (1.0, "grouped")}


def variants(run_cfg, device, dtype) -> list:
    c = run_cfg.model
    shared = ("vocab_size", "max_seq_len", "n_layers", "n_heads", "n_kv_heads", "d_model", "attn_head_dim",
              "tie_embeddings")
    dense = get_config("qwen3", "tiny").replace(**{f: getattr(c, f) for f in shared},
                                                ffn_dim=c.experts_per_token * c.moe_ffn_dim)
    models = {"dense (same active)": build_model("qwen3", dense)}
    for name, (cf, dropless) in DISPATCH.items():
        models[f"moe {name}"] = build_model("qwen3_moe", c.replace(capacity_factor=cf, dropless=dropless))
    b, t = run_cfg.data.batch_size, run_cfg.data.seq_len
    tokens = random.randint(random.key(1234), (b, t + 1), 0, c.vocab_size).to(device)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    out = []
    for name, model in models.items():
        tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(run_cfg.optim.learning_rate))
        holder = {"state": TrainState.create(params=to_device(model.init(random.key(0)), device), tx=tx,
                                             key=random.key(1, device=device))}
        step = jit(train_step(lm_loss(model), tx, microbatches=run_cfg.microbatches,
                              compute_dtype=None if dtype == torch.float32 else dtype), backend="inductor")

        def run(step=step, holder=holder):
            holder["state"], metrics = step(holder["state"], batch)
            sync(device)
            return metrics["loss"]

        out.append(Variant(name, run, lambda: 0, notes=f"{count_params(model) / 1e6:.3f}M params"))
    return out


def layer_variants(cfg, tokens: int, device, dtype=torch.float32) -> list:
    """One MoE layer of `cfg` (the default dropless) and the SwiGLU of the same active width, forward and
    backward of a squared-output loss on `tokens` tokens in `dtype` (parameters and inputs cast as under
    `compute_dtype`), each compiled by `jit(backend="inductor")`; and the
    layer's three grouped matmuls alone, on rows already sorted by its router (what the kernel costs without
    routing), also with gate and up as one grouped matmul of twice the width (a design measured, not used)."""
    from ember.core import value_and_grad
    from ember.models.llama3.model import SwiGLU

    dense = SwiGLU(cfg.d_model, cfg.experts_per_token * cfg.moe_ffn_dim)
    moe = build_model("qwen3_moe", cfg).experts(inits.normal(0.02))
    x = random.normal(random.key(2), (1, tokens, cfg.d_model)).to(device, dtype)
    moe_params = tree_cast(to_device(moe.init(random.key(0)), device), dtype)
    with torch.no_grad():
        routing = moe.call("router", moe_params, x[0])
        pairs = sort_pairs(routing.indices, cfg.n_experts, align=grouped_mm_row_alignment(x.dtype, device.type))
        rows = torch.cat([x[0], x.new_zeros(1, cfg.d_model)])[pairs.source]  # alignment rows read the zero row
        used = (pairs.source < tokens)[:, None]
    experts = {name: moe_params[name] for name in ("gate", "up", "down")}

    def layer_loss(layer):
        def loss(params, x):
            y = layer.apply(params, x)
            return (y[0] if isinstance(y, tuple) else y).square().mean()
        return loss

    def matmuls_loss(params, rows, fused):
        if fused:  # gate and up as one grouped matmul of twice the width
            gate, up = grouped_mm(rows, torch.cat([params["gate"], params["up"]], 1).mT, pairs.ends).chunk(2, -1)
            out = grouped_mm(torch.nn.functional.silu(gate) * up, params["down"].mT, pairs.ends)
        else:  # the layer's own
            out = grouped_swiglu(params, rows, pairs.ends)
        return torch.where(used, out, 0.0).square().mean()  # rows past the last group's end hold no value

    dense_params = tree_cast(to_device(dense.init(random.key(0)), device), dtype)
    cases = {"layer: dense SwiGLU (same active)": (layer_loss(dense), dense_params, x),
             "layer: moe dropless": (layer_loss(moe), moe_params, x)}
    if grouped_mm_runs(x.dtype, device.type, cfg.d_model, cfg.moe_ffn_dim):
        cases["layer: grouped matmuls alone"] = (lambda p, r: matmuls_loss(p, r, False), experts, rows)
        cases["layer: grouped matmuls alone, gate and up as one"] = (lambda p, r: matmuls_loss(p, r, True),
                                                                     experts, rows)
    out = []
    for name, (loss, params, inputs) in cases.items():
        step = jit(value_and_grad(loss), backend="inductor")

        def run(step=step, params=params, inputs=inputs):
            value, _ = step(params, inputs)
            sync(device)
            return value

        out.append(Variant(name, run, lambda: 0))
    return out


def layer_activation_bytes(cfg, tokens: int, dropless: str, dtype=torch.bfloat16) -> int:
    """Bytes one MoE layer of `cfg` keeps for its backward over one sequence of `tokens` tokens in `dtype`:
    the storage of every tensor eager autograd saves that is not a parameter, counted once (an expanded
    view counts what it views). Runs on the meta device."""
    layer = build_model("qwen3_moe", cfg.replace(dropless=dropless)).experts(inits.normal(0.02))
    params = pytree.tree_map(lambda p: p.to(dtype).requires_grad_(), layer.param_shapes())
    weights = {id(p) for p in pytree.tree_leaves(params)}
    saved = {}

    def pack(t):
        base = t if t._base is None else t._base
        if id(base) not in weights:
            saved[id(base)] = base
        return t

    x = torch.empty(1, tokens, cfg.d_model, device="meta", dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.apply(params, x)
    return sum(t.untyped_storage().nbytes() for t in saved.values())


def memory_rows(name: str, cfg, eps=(1, 2, 4), fsdp: int = 8) -> list:
    """(mesh, experts per device, params + AdamW per device in GiB) at fsdp x ep."""
    model = build_model("qwen3_moe", cfg)
    shapes = model.param_shapes()
    state = TrainState.create(params=shapes, tx=optim.adamw(1e-3), key=torch.zeros((), dtype=torch.int64))
    rows = []
    for ep in eps:
        mesh = Mesh.parse(f"fsdp={fsdp},ep={ep}" if ep > 1 else f"fsdp={fsdp}", backend="xla").in_order(MESH_ORDER)
        table = sharding_table(state, mesh, axes=model.axes)
        gate = next(r for r in table if r.path.endswith("mlp.gate") and r.kind == "param")
        experts = gate.local_shape[-3]  # (layers, experts, hidden, embed) stacked; (experts, ...) in a list
        rows.append((name, str(mesh), experts, memory_per_device(table).total / 2**30))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3_moe_tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--markdown")
    args, overrides = p.parse_known_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_cfg, dtype = parse_cli(args.config, overrides), getattr(torch, args.dtype)
    vs = variants(run_cfg, device, dtype)
    timed = time_round_robin(vs, warmup=args.warmup, iters=args.iters)
    layer_vs = layer_variants(run_cfg.model, run_cfg.data.batch_size * run_cfg.data.seq_len, device, dtype)
    layer_timed = time_round_robin(layer_vs, warmup=args.warmup, iters=args.iters)
    tokens = run_cfg.data.batch_size * run_cfg.data.seq_len
    dense_s = percentile(timed[vs[0].name]["times"], 0.5)
    peak = matmul_peak(device, dtype=dtype) if device.type == "cuda" else None  # the peak of the dtype it runs in
    command = " ".join(["python launch/bench_moe.py --config", args.config, "--dtype", args.dtype, *overrides])
    lines = [f"torch {torch.__version__}, {device.type}, {args.dtype}, {tokens} tokens per step in "
             f"{run_cfg.microbatches} microbatch(es), median of "
             f"{args.iters} round-robin steps (`{command}`)",
             "", "| variant | params | step ms | tokens/s | vs dense |" + (" MFU (active) |" if peak else ""),
             "|---|---|---|---|---|" + ("---|" if peak else "")]
    flops_per_token = 6 * count_active_params(build_model("qwen3_moe", run_cfg.model))
    for v in vs:
        s = percentile(timed[v.name]["times"], 0.5)
        mfu = f" {flops_per_token * tokens / s / peak['flops']:.1%} |" if peak else ""
        lines.append(f"| {v.name} | {v.notes} | {s * 1e3:.1f} | {tokens / s:,.0f} | {dense_s / s:.2f}x |{mfu}")
    dense_layer_s = percentile(layer_timed[layer_vs[0].name]["times"], 0.5)
    lines += ["", f"| one layer, forward and backward ({args.dtype}) | ms | vs dense |", "|---|---|---|"]
    for v in layer_vs:
        s = percentile(layer_timed[v.name]["times"], 0.5)
        lines.append(f"| {v.name.split(': ')[1]} | {s * 1e3:.1f} | {dense_layer_s / s:.2f}x |")
    lines += ["", "| model | mesh | experts per device | params + AdamW per device |", "|---|---|---|---|"]
    mem = memory_rows(args.config, run_cfg.model) + memory_rows("qwen3_moe/30b-a3b", get_config("qwen3_moe", "30b-a3b"))
    lines += [f"| {n} | {m} | {e} | {g:.3f} GiB |" for n, m, e, g in mem]
    big = get_config("qwen3_moe", "30b-a3b")
    lines += ["", f"Activations one MoE layer of Qwen3-30B-A3B keeps for its backward, one sequence of {LAYER_TOKENS} "
              f"tokens in bfloat16 (meta device):", "", "| dropless | GiB |", "|---|---|"]
    lines += [f"| {kind} | {layer_activation_bytes(big, LAYER_TOKENS, kind) / 2**30:.2f} |" for kind in DROPLESS]
    text = "\n".join(lines)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"timed": timed, "memory": mem}, f, indent=1, default=str)
    if args.markdown:
        update_markdown(args.markdown, "## Mixture of experts\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
