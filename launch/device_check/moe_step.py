"""Stage d: qwen3_moe_tiny's train step (dropless routing) against its dense twin, compiled, timed round-robin.

    python -m ember.launch.device_check.moe_step --backend inductor --dtype bfloat16 --warmup 2 --iters 10

The dense twin is `launch/bench_moe.py`'s: the same model with one SwiGLU of width
`experts_per_token * moe_ffn_dim`, so a token goes through the same parameters in both. Reports
the first call (trace + compile + run), median step ms, tokens/s, MFU on active parameters against
the measured matmul peak, and the losses.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from typing import Any, Dict, List

import torch

from ember import optim
from ember.core import TrainState, device_for, jit, random, to_device
from ember.core.step_fns import train_step
from ember.launch.benchmark import Variant, matmul_peak, time_round_robin
from ember.launch.benchmark.setup import sync
from ember.launch.benchmark.timing import percentile
from ember.launch.run_config import get_config as get_run_config
from ember.models import build_model, count_active_params, count_params, get_config, lm_loss

from .common import count_warnings, emit

_SHARED = ("vocab_size", "max_seq_len", "n_layers", "n_heads", "n_kv_heads", "d_model", "attn_head_dim",
           "tie_embeddings")


def twins(moe_cfg: Any) -> Dict[str, Any]:
    """`{"dense": model, "moe dropless": model}`: the MoE and the dense model of its active width."""
    dense = get_config("qwen3", "tiny").replace(**{f: getattr(moe_cfg, f) for f in _SHARED},
                                                ffn_dim=moe_cfg.experts_per_token * moe_cfg.moe_ffn_dim)
    return {"dense": build_model("qwen3", dense), "moe dropless": build_model("qwen3_moe", moe_cfg)}


def _variants(models: Dict[str, Any], batch: Dict[str, torch.Tensor], device: torch.device, *, backend: str,
              dtype: torch.dtype, learning_rate: float) -> List[Variant]:
    out = []
    for name, model in models.items():
        tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(learning_rate))
        box = {"state": TrainState.create(params=to_device(model.init(random.key(0)), device), tx=tx,
                                          key=random.key(1, device=device))}
        step = jit(train_step(lm_loss(model), compute_dtype=None if dtype == torch.float32 else dtype),
                   backend=backend, donate="state")

        def run(step=step, box=box):
            box["state"], metrics = step(box["state"], batch)
            sync(device)
            return metrics["loss"]

        out.append(Variant(name, run, lambda: 0, notes=f"{count_params(model) / 1e6:.3f}M params"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3_moe_tiny")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--n-layers", type=int, help="fewer layers (the check's CPU mode)")
    p.add_argument("--peak-reps", type=int, default=10)
    args = p.parse_args(argv)
    res: Dict[str, Any] = {"torch": torch.__version__, "backend": args.backend, "dtype": args.dtype}
    try:
        run_cfg, device, dtype = get_run_config(args.config), device_for("inductor"), getattr(torch, args.dtype)
        c = run_cfg.model if args.n_layers is None else run_cfg.model.replace(n_layers=args.n_layers)
        b, t = run_cfg.data.batch_size, run_cfg.data.seq_len
        tokens = random.randint(random.key(1234), (b, t + 1), 0, c.vocab_size).to(device)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}  # (B, T) each
        variants = _variants(twins(c), batch, device, backend=args.backend, dtype=dtype,
                             learning_rate=run_cfg.optim.learning_rate)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            timed = time_round_robin(variants, warmup=args.warmup, iters=args.iters)
        peak = matmul_peak(device, reps=args.peak_reps, dtype=getattr(torch, args.dtype))  # the dtype it computes in
        active = count_active_params(build_model("qwen3_moe", c))
        flops_per_token = 6 * active
        res.update(device=str(device), tokens_per_step=b * t, active_params=active,
                   peak_tflops=peak["flops"] / 1e12, n_experts=c.n_experts, experts_per_token=c.experts_per_token,
                   warnings=count_warnings(caught), variants={})
        for v in variants:
            r, med = timed[v.name], percentile(timed[v.name]["times"], 0.5)
            res["variants"][v.name] = {"params": v.notes, "first_call_s": round(r["first_call_s"], 2),
                                       "median_ms": round(1e3 * med, 3), "tokens_per_s": round(b * t / med),
                                       "mfu_active": flops_per_token * b * t / med / peak["flops"],
                                       "first_loss": r["first_loss"], "last_loss": r["last_loss"]}
        dense, moe = (res["variants"][k]["median_ms"] for k in ("dense", "moe dropless"))
        res["moe_over_dense"] = moe / dense
    except Exception as e:  # noqa: BLE001 - the stage reports any failure on its result line
        res["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    emit("moe", res)
    return 1 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
