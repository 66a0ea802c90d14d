"""Remat policies and scan_layers against the unrolled, remat-free reference, shared by the in-process and XLA tests.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 python tests/models/_remat_scan_parity.py xla   # prints JSON

`run(family, backend)` trains each variant of a tiny model two steps (SGD, one `train_step` through
`ember.core.jit` on `backend`) from the same weights and returns, per variant, the largest
difference from the reference in the metrics and in every updated parameter (scanned params are
unstacked into the reference's list of blocks).
"""

from __future__ import annotations

import json
import sys

import torch

POLICIES = ("full", "dots_saveable", "dots_with_no_batch_dims_saveable", "save:qkv,attn_out,mlp_hidden")
VARIANTS = ["none+scan"] + [p + scan for p in POLICIES for scan in ("", "+scan")]
# Compiled backends take ~20 s per variant on 2 CPU cores: they run a subset covering each policy once.
COMPILED_VARIANTS = {
    "llama3": ["full+scan", "none+scan", "dots_saveable", "save:qkv,attn_out,mlp_hidden+scan"],
    "gpt2": ["dots_with_no_batch_dims_saveable+scan"],
    "qwen3_moe": ["full+scan"],  # a tree carry: the router statistics ride along
    "deepseek_v3": ["save:qkv,attn_out,mlp_hidden+scan"],  # a dense block, then MoE ones: two stacks
}


def _config(family: str, **changes):
    from ember.models import GPT2Config, Llama3Config, get_config

    if family == "qwen3_moe":
        return get_config("qwen3_moe", "tiny").replace(vocab_size=64, max_seq_len=16, n_layers=3, d_model=32,
                                                      attn_head_dim=8, moe_ffn_dim=16, n_experts=4,
                                                      capacity_factor=1.0, router_z_loss_coef=1e-3, **changes)
    if family == "deepseek_v3":  # latent attention, a dense first layer, dropless (grouped where the kernel runs)
        return get_config("deepseek_v3", "tiny").replace(vocab_size=64, max_seq_len=16, n_layers=3, d_model=32,
                                                        n_heads=4, n_kv_heads=4, q_lora_rank=16, kv_lora_rank=8,
                                                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                                        moe_ffn_dim=16, n_experts=4, n_expert_groups=2, topk_groups=1,
                                                        router_z_loss_coef=1e-3, **changes)
    if family == "llama3":
        return Llama3Config(vocab_size=64, max_seq_len=16, n_layers=3, n_heads=4, n_kv_heads=2, d_model=32,
                            ffn_dim=48, rope_theta=10000.0, **changes)
    return GPT2Config(vocab_size=64, max_seq_len=16, n_layers=3, n_heads=4, d_model=32, dropout=0.0, **changes)


def _train(family: str, backend: str, remat: str, scan: bool, device: torch.device):
    from ember import optim
    from ember.core import TrainState, random
    from ember.core.jit import jit
    from ember.core.pytree import tree_map
    from ember.core.step_fns import train_step
    from ember.models import build_model, lm_loss

    reference = build_model(family, _config(family, scan_layers=False))
    model = build_model(family, _config(family, remat=remat, scan_layers=scan))
    params = reference.init(random.key(0))
    blocks = model.children["blocks"] if scan else None
    if scan:  # one stack, or one per run of equal blocks (dense, then MoE)
        params = {**params, "blocks": blocks.stack(params["blocks"])}
    tokens = random.randint(random.key(1), (4, 9), 0, 64)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:].clone()}
    batch["targets"][0, :5] = -100
    to = lambda tree: tree_map(lambda t: t.to(device), tree)  # noqa: E731
    state = to(TrainState.create(params=params, tx=optim.sgd(0.5), key=random.key(2)))
    step = jit(train_step(lm_loss(model), microbatches=2), backend=backend, donate="none")
    metrics = []
    for _ in range(2):
        state, m = step(state, to(batch))
        metrics.append({k: float(v.cpu()) for k, v in m.items()})
    final = tree_map(lambda t: t.cpu(), state.params)
    if scan:
        final = {**final, "blocks": blocks.unstack(final["blocks"])}
    return metrics, final


def run(family: str, backend: str, variants=VARIANTS) -> dict:
    """`{variant: {"metrics": max |diff|, "params": max |diff|}}` against remat "none", unrolled.

    A variant is a remat policy, with "+scan" for `scan_layers=True`.
    """
    device = torch.device("cpu")
    if backend == "xla":
        import torch_xla

        device = torch_xla.device()
    # Inductor's variants are held to eager's unrolled run (within TOL: SGD), which costs no compile.
    ref_metrics, ref_params = _train(family, "eager" if backend == "inductor" else backend, "none", False, device)
    out = {}
    for variant in variants:
        remat, scan = variant.removesuffix("+scan"), variant.endswith("+scan")
        metrics, params = _train(family, backend, remat, scan, device)
        metric_diff = max(abs(a[k] - b[k]) for a, b in zip(metrics, ref_metrics) for k in a)
        param_diff = max(
            float((a - b).abs().max()) for a, b in zip(torch.utils._pytree.tree_leaves(params),
                                                       torch.utils._pytree.tree_leaves(ref_params))
        )
        out[variant] = {"metrics": metric_diff, "params": param_diff}
    return out


if __name__ == "__main__":
    print(json.dumps({f: run(f, sys.argv[1], vs) for f, vs in COMPILED_VARIANTS.items()}))
