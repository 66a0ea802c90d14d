"""`--init_from`: a run starts from a Hugging Face folder or an ember checkpoint, after its
architecture is checked against the run config (differences named)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ember.core import TrainState, pytree, random
from ember.core.checkpoint import CheckpointError, CheckpointManager, model_info
from ember.launch import build
from ember.launch.init_from import check_init_from
from ember.launch.run_config import parse_cli
from ember.models import build_model, to_hf
from ember import optim


def _assert_same(a, b):
    pytree.tree_map(lambda x, y: torch.testing.assert_close(x, y, rtol=0, atol=0), a, b)


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    """An HF Qwen2 folder holding the `qwen2_tiny` architecture, with weights unlike a fresh init."""
    cfg = parse_cli("qwen2_tiny", [])
    model = build_model(cfg.family, cfg.model.replace(scan_layers=False))  # a list of blocks, as HF holds them
    params = model.init(random.key(7))
    path = tmp_path_factory.mktemp("qwen2")
    to_hf(model, params, path)
    return str(path), params


def test_a_run_starts_from_a_hugging_face_folder(qwen2_folder):
    path, saved = qwen2_folder
    cfg = parse_cli("qwen2_tiny", ["--init_from", path])
    model = build_model(cfg.family, cfg.model)
    state = build.initial_state(cfg, model)
    assert int(state.step) == 0
    stacked = state.params["blocks"]["attn"]["wq"]["bias"]
    assert stacked.shape[0] == cfg.model.n_layers  # loaded into the configured (scanned) layout
    torch.testing.assert_close(stacked[1], saved["blocks"][1]["attn"]["wq"]["bias"], rtol=0, atol=0)
    _assert_same(state.params["wte"], saved["wte"])


def test_a_bfloat16_folder_still_trains_float32_master_weights(qwen2_folder, tmp_path):
    _, saved = qwen2_folder
    cfg = parse_cli("qwen2_tiny", ["--init_from", str(tmp_path)])
    to_hf(build_model(cfg.family, cfg.model.replace(scan_layers=False)), saved, tmp_path, dtype=torch.bfloat16)
    params = build.initial_state(cfg, build_model(cfg.family, cfg.model)).params
    assert {t.dtype for t in pytree.tree_leaves(params)} == {torch.float32}
    torch.testing.assert_close(params["wte"]["weight"], saved["wte"]["weight"].bfloat16().float(), rtol=0, atol=0)


def test_another_architecture_is_refused_with_each_difference(qwen2_folder):
    path, _ = qwen2_folder
    cfg = parse_cli("qwen2_tiny", ["--init_from", path, "--model.d_model", "96", "--model.n_layers", "2"])
    with pytest.raises(ValueError) as refused:
        build.initial_state(cfg, build_model(cfg.family, cfg.model))
    assert str(refused.value) == (f"--init_from {path}: the folder holds another qwen2 model than the run config: "
                                  f"d_model 192 there, 96 configured; n_layers 4 there, 2 configured. To start from "
                                  f"it, set --model.d_model 192 --model.n_layers 4.")
    far = dataclasses.replace(cfg.model, n_heads=2, n_kv_heads=1, ffn_dim=64)  # 5 fields: another config is nearer
    with pytest.raises(ValueError, match=r"d_model 192 there, 96 configured; .*\. To start from it, use --config "
                                         r"qwen2_tiny\.$"):
        check_init_from(path, cfg.family, far, config_name="tiny_chat_sft")  # as launch/train.py checks, by name
    cfg = parse_cli("llama3_tiny", ["--init_from", path])
    with pytest.raises(ValueError, match=r"holds a qwen2 model and the run config a llama3 one \(norm_eps 1e-06 "
                                         r"there, 1e-05 configured; qkv_bias True there, False configured; rope_theta "
                                         r"1000000.0 there, 10000.0 configured\)\. To start from it, use --config "
                                         r"qwen2_tiny\.$"):
        build.initial_state(cfg, build_model(cfg.family, cfg.model))


def test_a_run_starts_from_an_ember_checkpoint_and_refuses_another_models(tmp_path):
    cfg = parse_cli("llama3_tiny", ["--init_from", str(tmp_path)])
    model = build_model(cfg.family, cfg.model)
    params = model.init(random.key(11))
    state = TrainState.create(params=params, tx=optim.adamw(1e-3), key=random.key(0))
    with CheckpointManager(tmp_path / "checkpoints", async_save=False) as ckpt:
        ckpt.save(5, state, model_info=model_info(cfg.family, cfg.model, arch="llama3_tiny"), force=True)
    started = build.initial_state(cfg, model)
    assert int(started.step) == 0
    _assert_same(started.params, params)
    other = parse_cli("gpt2_tiny", ["--init_from", str(tmp_path)])
    with pytest.raises(CheckpointError, match=r"gpt2"):
        build.initial_state(other, build_model(other.family, other.model))
