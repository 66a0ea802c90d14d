"""ember.launch.throughput: the FLOPs behind MFU are FlopCounterMode's of the real step, an MoE's at its active experts."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ember import data
from ember.data.config import DataConfig
from ember.launch import build
from ember.launch.run_config import TrainConfig
from ember.launch.throughput import active_flops_config, peak_flops, step_flops
from ember.models import get_config

SHAPES = dict(vocab_size=320, n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=32)
MODELS = [  # (family, model config overrides)
    ("llama3", {}),
    ("qwen3_moe", dict(moe_ffn_dim=32)),  # 2 layers of routed experts (the tiny family's E and k)
]


def _cfg(family, **model):
    return TrainConfig(family=family, model=get_config(family, "tiny").replace(**SHAPES, **model), backend="eager",
                       data=DataConfig(max_bytes=30_000, seq_len=32, batch_size=4))


def _state_and_batch(cfg):
    model = build.build_model(cfg)
    batch = next(iter(data.build_batches(cfg.data, tokenizer=build.build_tokenizer(cfg, model))))
    return build.initial_state(cfg, model), batch


def _counted_for_real(cfg, state, batch):
    """FlopCounterMode's count of the step run eagerly on real tensors."""
    with FlopCounterMode(display=False) as counter:
        build.step_fn(cfg, build.build_model(cfg))(state, batch)
    return counter.get_total_flops()


@pytest.mark.parametrize("family, model", MODELS, ids=[m[0] for m in MODELS])
def test_the_fake_count_is_the_real_steps(family, model):
    cfg = _cfg(family, **model)
    state, batch = _state_and_batch(cfg)
    counted = step_flops(cfg)(state, batch)
    real = _counted_for_real(active_flops_config(cfg), state, batch)  # for a dense model: cfg itself
    assert counted == pytest.approx(real, rel=0.01) and counted > 0
    assert (active_flops_config(cfg) is cfg) == (family == "llama3")


def test_an_moe_counts_its_routed_pairs_not_a_slot_per_token_for_every_expert():
    """The experts' FLOPs grow with the k * tokens pairs routed, as active parameters do: halving each expert's
    width removes 18 * d * (I / 2) FLOPs (3 matmuls, forward and backward) per routed pair and MoE layer."""
    cfg = _cfg("qwen3_moe", moe_ffn_dim=32)
    state, batch = _state_and_batch(cfg)
    narrow = dataclasses.replace(cfg, model=cfg.model.replace(moe_ffn_dim=16))
    narrow_state, _ = _state_and_batch(narrow)
    c = cfg.model
    pairs = batch["inputs"].numel() * c.experts_per_token
    assert c.n_experts > c.experts_per_token  # else every expert is active and the check proves nothing
    per_pair_and_layer = 18 * c.d_model * (c.moe_ffn_dim - narrow.model.moe_ffn_dim)
    difference = step_flops(cfg)(state, batch) - step_flops(narrow)(narrow_state, batch)
    assert difference == per_pair_and_layer * pairs * c.n_layers


def test_known_gpus_use_the_datasheet_and_others_are_measured(monkeypatch):
    for name, dtype, tf32, tflops in [("NVIDIA H100 80GB HBM3", torch.bfloat16, True, 989.4),
                                      ("NVIDIA H100 PCIe", torch.bfloat16, True, 756.0),
                                      ("NVIDIA H200", torch.float32, True, 494.7),
                                      ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5),
                                      ("NVIDIA L40S", torch.bfloat16, True, 362.05),
                                      ("NVIDIA L4", torch.float16, True, 121.0),
                                      ("NVIDIA A10G", torch.bfloat16, True, 70.0)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        peak, source = peak_flops("cuda", dtype, tf32=tf32)
        assert peak == tflops * 1e12 and source == f"{name} datasheet", name
    peak, source = peak_flops("cpu")
    assert 1e8 < peak < 1e14 and source == "measured on cpu"
