"""`launch/bench_moe.py`'s figures that need no timing: memory per expert-parallel degree and per layer (active
parameters: `tests/models/test_moe_hf_config.py`)."""

import importlib.util
import pathlib

from ember.models import get_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "launch" / "bench_moe.py")
bench_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_moe)


def test_memory_per_device_falls_with_the_expert_parallel_degree():
    rows = bench_moe.memory_rows("30b", get_config("qwen3_moe", "30b-a3b"))
    meshes = [(mesh, experts) for _, mesh, experts, _ in rows]
    assert meshes == [("fsdp=8", 128), ("fsdp=8,ep=2", 64), ("fsdp=8,ep=4", 32)]
    gib = [g for *_, g in rows]
    assert gib[0] > gib[1] > gib[2] and round(gib[0], 1) == 42.7  # 30.5B x (param + 2 moments) x 4 B / 8


def test_grouped_activations_grow_with_the_routed_pairs_and_padded_ones_with_the_experts():
    """One layer of Qwen3-30B-A3B at 512 tokens: quartering the experts leaves the grouped layer's saved
    activations nearly as they were (its rows are the k routed pairs) and quarters most of the padded one's."""
    full = get_config("qwen3_moe", "30b-a3b")
    fewer = full.replace(n_experts=32)
    grouped = [bench_moe.layer_activation_bytes(c, 512, "grouped") for c in (full, fewer)]
    padded = [bench_moe.layer_activation_bytes(c, 512, "padded") for c in (full, fewer)]
    assert grouped[1] <= grouped[0] < 1.05 * grouped[1], grouped
    assert padded[0] > 3 * padded[1] and padded[1] > 3 * grouped[1], padded


def test_layer_variants_run_and_fusing_gate_and_up_computes_the_same():
    """Every one-layer variant runs compiled; where the grouped kernel runs (float32 traces from torch 2.15),
    the grouped matmuls with gate and up as one matmul give the separate ones' loss (the fused design is
    timed as the same computation)."""
    import torch

    from ember.core.compat.grouped_mm import grouped_mm_runs

    cfg = get_config("qwen3_moe", "tiny")
    values = {v.name: v.step() for v in bench_moe.layer_variants(cfg, 64, torch.device("cpu"))}
    assert all(torch.isfinite(v) for v in values.values()), values
    kernel_runs = grouped_mm_runs(torch.float32, "cpu", cfg.d_model, cfg.moe_ffn_dim)
    assert len(values) == (4 if kernel_runs else 2), list(values)
    if kernel_runs:
        separate, fused = (values[f"layer: grouped matmuls alone{s}"] for s in ("", ", gate and up as one"))
        torch.testing.assert_close(fused, separate, rtol=1e-5, atol=0)
