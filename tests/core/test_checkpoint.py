"""ember.core.checkpoint: bit-exact round trips, async saves, retention, metadata, bad input, sharding.

Resume-from-training and crash tests live in test_checkpoint_resume.py.
"""

import logging
import os
import pathlib
import re
import shutil

import pytest
import torch

from ember import optim
from ember.core import TrainState, random
from ember.core.checkpoint import CheckpointError, CheckpointManager, CheckpointMeta, model_info
from ember.launch.run_config import TrainConfig
from ember.core.mesh import Mesh
from ember.core.partition_specs import Sharding, for_mesh
from ember.core.pytree import tree_leaves_with_path
from ember.models import build_model

LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16)


def _bits(x):
    """A tensor's raw bytes, so NaN payloads and -0.0 compare exactly."""
    return x.reshape(-1).contiguous().view(torch.uint8) if x.numel() else x


def assert_bit_equal(a, b):
    la, lb = tree_leaves_with_path(a), tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, (path, x.dtype, y.dtype, x.shape, y.shape)
            assert torch.equal(_bits(x), _bits(y)), path
        else:
            assert x == y, path


def snapshot(root):
    """Every path under `root` with its size and mtime: equal snapshots mean nothing was touched."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = pathlib.Path(dirpath) / name
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size if p.is_file() else None, st.st_mtime_ns)
    return out


def mixed_state():
    """Every kind of leaf a training state holds, with awkward values."""
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40, -3.5])
    return {
        "params": {
            "w": torch.randn(7, 5),
            "special": special,
            "bf16": torch.randn(4, 3).to(torch.bfloat16),
            "f16": torch.randn(3).half(),
            "f8": torch.randn(6).to(torch.float8_e4m3fn),
            "transposed": torch.randn(3, 4).t(),  # a non-contiguous view
            "empty": torch.empty(0, 4),
        },
        "count": torch.tensor(2**62 + 7, dtype=torch.int64),  # 0-d int64 beyond float precision
        "key": random.key(12345),
        "lr": torch.tensor(3e-4),  # 0-d hyperparameter tensor
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(10, dtype=torch.uint8),
        "layers": [torch.ones(2), (torch.zeros(1, dtype=torch.int32),)],
        "epoch": 3,  # a Python scalar leaf
        "note": "warm",
    }


@pytest.mark.parametrize("async_save, compress", [(True, False), (False, False), (True, True)],
                         ids=["async", "sync", "async-zstd"])
def test_round_trip_is_bit_exact_for_every_dtype(tmp_path, async_save, compress):
    state = mixed_state()
    with CheckpointManager(tmp_path, async_save=async_save, compress=compress) as ckpt:
        assert ckpt.save(1, state) is True
        ckpt.wait()
        restored, data_state, meta = ckpt.restore(like=state)
    assert_bit_equal(restored, state)
    assert data_state is None and meta.step == 1
    assert restored["count"].item() == 2**62 + 7 and restored["layers"][1][0].dtype == torch.int32
    assert restored["params"]["transposed"].is_contiguous()


def test_restored_cpu_tensors_share_memory_with_what_orbax_read(tmp_path):
    state = {"params": {"w": torch.randn(64, 64)}}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state)
        restored, _, _ = ckpt.restore(like=state)
    w = restored["params"]["w"]
    assert w.data_ptr() != state["params"]["w"].data_ptr() and w.is_contiguous() and w._base is None


def test_trainstate_round_trip_takes_static_fields_from_the_template(tmp_path):
    model = build_model("llama3", "tiny", **LLAMA)
    tx = optim.adamw(1e-3)
    state = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(7))
    state = state.apply_gradients(grads=state.params)  # non-trivial mu / nu / count
    other = TrainState.create(params=model.init(random.key(1)), tx=tx, key=random.key(8))
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state)
        restored, _, _ = ckpt.restore(like=other)
    assert restored.tx is tx
    assert_bit_equal(restored, state)


def test_async_save_returns_before_commit_and_training_may_overwrite_the_state(tmp_path):
    state = {"params": {"w": torch.randn(256, 1024)}, "step": torch.tensor(5)}
    expected = {"params": {"w": state["params"]["w"].clone()}, "step": torch.tensor(5)}
    with CheckpointManager(tmp_path, async_save=True) as ckpt:
        ckpt.save(5, state)
        assert ckpt.latest_step() == 5  # known to the manager while the write is in flight
        state["params"]["w"].mul_(2).add_(1)  # what a donated step does to the buffers
        state["step"].add_(1)
        ckpt.wait()
        assert (tmp_path / "5").is_dir() and not list(tmp_path.glob("*orbax-checkpoint-tmp*"))
        restored, _, _ = ckpt.restore(like=state)
    assert_bit_equal(restored, expected)


def test_save_every_force_and_latest_step(tmp_path):
    state = {"params": {"w": torch.ones(2)}}
    with CheckpointManager(tmp_path, save_every=5) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        assert ckpt.save(3, state) is False and ckpt.should_save(5)
        assert ckpt.save(5, state) is True
        assert ckpt.save(7, state) is False
        assert ckpt.save(7, state, force=True) is True  # the last step of a run
        ckpt.wait()
        assert ckpt.all_steps() == [5, 7] and ckpt.latest_step() == 7
    assert CheckpointManager(tmp_path, read_only=True).latest_step() == 7  # a new process sees the same


def test_max_to_keep_prunes_the_oldest_after_each_commit(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, {"params": {"w": torch.full((3,), float(step))}})
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]


@pytest.mark.parametrize(
    "mode, losses, kept, best",
    [
        ("min", {1: 3.0, 2: 1.0, 3: 2.0, 4: None, 5: 2.5}, [2, 5], 2),
        ("max", {1: 3.0, 2: 1.0, 3: 2.0, 4: None, 5: 2.5}, [1, 5], 1),
    ],
    ids=["min", "max"],
)
def test_keep_best_keeps_the_best_step_beside_the_newest(tmp_path, mode, losses, kept, best):
    with CheckpointManager(tmp_path, max_to_keep=1, keep_best=("eval_loss", mode)) as ckpt:
        for step, loss in losses.items():
            metrics = {"loss": 9.0} if loss is None else {"eval_loss": torch.tensor(loss), "loss": 9.0}
            ckpt.save(step, {"params": {"w": torch.ones(1)}}, metrics=metrics)
        ckpt.wait()
        assert ckpt.all_steps() == kept and ckpt.best_step() == best
    reopened = CheckpointManager(tmp_path, max_to_keep=1, keep_best=("eval_loss", mode))
    assert reopened.best_step() == best and reopened.read_meta(best).metrics["eval_loss"] == losses[best]
    reopened.close()


def test_metadata_records_config_model_metrics_and_leaves(tmp_path):
    model = build_model("llama3", "tiny", **LLAMA)
    state = TrainState.create(params=model.init(random.key(0)), tx=optim.sgd(0.1))
    cfg = TrainConfig(family="llama3", model=model.config, steps=4)
    info = model_info("llama3", model.config, arch="tiny")
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(4, state, config=cfg, model_info=info, metrics={"loss": torch.tensor(2.5)},
                  data_state={"next_batch": 4, "config": {"seed": 0}})
        meta = ckpt.read_meta(4)
        assert ckpt.read_data_state() == {"next_batch": 4, "config": {"seed": 0}}
        assert ckpt.disk_bytes(4) > 4 * meta.num_elements  # float32, plus metadata
    assert isinstance(meta, CheckpointMeta) and meta.step == 4 and meta.metrics == {"loss": 2.5}
    assert meta.config["steps"] == 4 and meta.config["model"]["d_model"] == 32
    assert meta.model["family"] == "llama3" and meta.model["arch"] == "tiny" and meta.ember_version
    paths = {leaf.path: leaf for leaf in meta.leaves}
    assert paths["params.wte.weight"].shape == (64, 32) and paths["params.wte.weight"].dtype == "float32"
    assert paths["step"].shape == () and paths["step"].dtype == "int64" and paths["step"].crc32 is not None


def test_tied_tensors_are_stored_once_and_restored_tied(tmp_path):
    w = torch.randn(4, 4)
    state = {"params": {"embed": w, "head": w}}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state)
        restored, _, meta = ckpt.restore(like={"params": {"embed": torch.zeros(4, 4), "head": torch.zeros(4, 4)}})
    assert meta.aliases == {"params.head": "params.embed"} and len(meta.leaves) == 1
    assert restored["params"]["head"] is restored["params"]["embed"] and torch.equal(restored["params"]["head"], w)


def test_restore_params_reads_params_only_onto_a_meta_template(tmp_path):
    model = build_model("llama3", "tiny", **LLAMA)
    state = TrainState.create(params=model.init(random.key(0)), tx=optim.adamw(1e-3))
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(2, state)
    shutil.rmtree(tmp_path / "2" / "state")  # no optimizer state on disk at all: params still load
    with torch.device("meta"):
        like = model.init(random.key(0))
    ckpt = CheckpointManager(tmp_path, read_only=True)
    params = ckpt.restore_params(like=like)
    flat = ckpt.restore_params()
    ckpt.close()
    assert_bit_equal(params, state.params)
    assert params["wte"]["weight"].device.type == "cpu"
    assert set(flat) == {p for p, _ in tree_leaves_with_path(state.params)}
    assert torch.equal(flat["wte.weight"], state.params["wte"]["weight"])


# ---- bad input: clear errors, nothing on disk touched ---------------------------------------------


@pytest.fixture
def saved_llama(tmp_path):
    """A directory with steps 1 and 2 of a 2-layer llama, plus its state and model_info."""
    model = build_model("llama3", "tiny", **LLAMA)
    state = TrainState.create(params=model.init(random.key(0)), tx=optim.adamw(1e-3))
    info = model_info("llama3", model.config, arch="tiny")
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as ckpt:
        ckpt.save(1, state, model_info=info)
        ckpt.save(2, state, model_info=info)
    return root, state, info


def test_another_arch_is_refused_before_reading_naming_leaves_and_both_models(saved_llama):
    root, _, _ = saved_llama
    model = build_model("llama3", "tiny", **{**LLAMA, "n_layers": 3, "d_model": 48, "ffn_dim": 96},
                        scan_layers=False)  # a list of blocks: its leaves are not the stacked checkpoint's
    like = TrainState.create(params=model.init(random.key(0)), tx=optim.adamw(1e-3))
    before = snapshot(root)
    with CheckpointManager(root) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.restore(like=like, model_info=model_info("llama3", model.config, arch="tiny"))
    msg = str(err.value)
    assert "params.wte.weight: (64, 32) float32 vs (64, 48) float32" in msg
    assert "not in the checkpoint" in msg and "params.blocks.0." in msg
    assert "config.d_model: 32 (checkpoint) vs 48" in msg and "config.n_layers: 2 (checkpoint) vs 3" in msg
    assert "config.scan_layers: True (checkpoint) vs False" in msg
    assert snapshot(root) == before


def test_another_family_and_a_dtype_change_are_refused(saved_llama):
    root, state, info = saved_llama
    gpt = build_model("gpt2", "tiny", vocab_size=64, n_layers=1, d_model=32, n_heads=2, max_seq_len=16)
    like = TrainState.create(params=gpt.init(random.key(0)), tx=optim.adamw(1e-3))
    with CheckpointManager(root, read_only=True) as ckpt:
        with pytest.raises(CheckpointError, match=r"(?s)your model: gpt2.*model differences: family: 'llama3' \(checkpoint\) vs 'gpt2'\nFix"):
            ckpt.restore(like=like, model_info=model_info("gpt2", gpt.config))
        bf16 = state.replace(params={**state.params, "wte": {"weight": state.params["wte"]["weight"].bfloat16()}})
        with pytest.raises(CheckpointError, match=r"params.wte.weight: \(64, 32\) float32 vs \(64, 32\) bfloat16"):
            ckpt.restore(like=bf16)


def test_missing_step_lists_the_saved_steps(saved_llama):
    root, state, _ = saved_llama
    before = snapshot(root)
    with CheckpointManager(root) as ckpt, pytest.raises(CheckpointError, match=r"no checkpoint for step 7 .*saved steps: 1, 2"):
        ckpt.restore(7, like=state)
    assert snapshot(root) == before


def _largest_array_file(step_dir):
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def test_flipped_bytes_in_an_array_file_fail_the_crc_check(saved_llama):
    root, state, _ = saved_llama
    _flip_bytes(_largest_array_file(root / "2"))
    before = snapshot(root)
    with CheckpointManager(root) as ckpt:
        with pytest.raises(CheckpointError, match=r"step 2 in .* is corrupted: \d+ arrays do not match the CRC-32"):
            ckpt.restore(like=state)
        restored, _, _ = ckpt.restore(1, like=state)  # the earlier step is intact
    assert_bit_equal(restored, state)
    assert snapshot(root) == before


# orbax leaves an asyncio callback behind when tensorstore fails a read ("Event loop is closed").
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_truncated_array_file_is_a_clear_error(saved_llama):
    root, state, _ = saved_llama
    target = _largest_array_file(root / "2")
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    before = snapshot(root)
    with CheckpointManager(root) as ckpt, pytest.raises(CheckpointError, match=r"could not read .* of step 2 .*Restore an earlier step \(1\)"):
        ckpt.restore(like=state)
    assert snapshot(root) == before


def test_a_half_pruned_step_is_a_clear_error(saved_llama):
    """orbax prunes with a plain rmtree: a kill mid-prune leaves a step without some of its items."""
    root, state, _ = saved_llama
    shutil.rmtree(root / "1" / "params")
    (root / "1" / "_CHECKPOINT_METADATA").unlink()
    before = snapshot(root)
    with CheckpointManager(root) as ckpt:
        with pytest.raises(CheckpointError, match=r"could not read .* of step 1 .*no readable metadata for items \['params'\]"):
            ckpt.restore(1, like=state)
        assert_bit_equal(ckpt.restore(like=state)[0], state)  # the later step is intact
    assert snapshot(root) == before


def _flip_bytes(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 40):
        data[i] ^= 0x55
    path.write_bytes(bytes(data))


def test_verify_names_what_is_damaged_and_changes_nothing(saved_llama):
    root, _, _ = saved_llama
    _flip_bytes(_largest_array_file(root / "2"))
    before = snapshot(root)
    with CheckpointManager(root, read_only=True) as ckpt:
        assert ckpt.verify(1) == []
        [crc] = ckpt.verify()  # the latest: step 2
        assert re.fullmatch(r"CRC-32 mismatch in \d+ of \d+ arrays \([\w., ]+\)", crc), crc
    shutil.rmtree(root / "1" / "params")  # half-pruned
    (root / "1" / "_CHECKPOINT_METADATA").unlink()
    with CheckpointManager(root, read_only=True) as ckpt:
        assert ckpt.verify(1) == ["`params` unreadable: FileNotFoundError: no readable metadata for items ['params']"]
        shutil.rmtree(root / "1" / "meta")
        assert ckpt.verify(1) == ["no `meta` item (pruned or written half-way)"]
        with pytest.raises(CheckpointError, match=r"no checkpoint for step 5 .*saved steps: 1, 2"):
            ckpt.verify(5)
    assert set(snapshot(root)) <= set(before)


def test_restoring_a_data_state_logs_no_orbax_warning(tmp_path, caplog):
    """orbax warned twice per restore that the `data` item "could not be restored" (it was)."""
    state = {"params": {"w": torch.arange(3.0)}, "count": torch.zeros(())}
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state, data_state={"next_batch": 7})
    with caplog.at_level(logging.INFO, logger="absl"), CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(like=state)[1] == {"next_batch": 7}
        assert ckpt.restore_params()["w"].tolist() == [0.0, 1.0, 2.0]
        assert ckpt.read_data_state() == {"next_batch": 7} and ckpt.verify() == []
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_directories_that_are_not_checkpoints(tmp_path, saved_llama):
    root, state, _ = saved_llama
    run = tmp_path / "run"
    (run / "2024").mkdir(parents=True)
    (run / "2024" / "notes.txt").write_text("mine")
    (run / "metrics.jsonl").write_text("{}\n")
    before = snapshot(run)
    with pytest.raises(CheckpointError, match=r"folders named like checkpoint steps that are not checkpoints: 2024"):
        CheckpointManager(run)  # orbax would count 2024 as a step and could prune it
    with CheckpointManager(run, read_only=True) as ckpt:
        with pytest.raises(CheckpointError, match=r"2024 is not an ember checkpoint step: it has no `meta` item"):
            ckpt.restore(like=state)
    (run / "2024" / "notes.txt").unlink()
    (run / "2024").rmdir()
    with CheckpointManager(run, read_only=True) as ckpt:
        with pytest.raises(CheckpointError, match=r"holds no ember checkpoint \(it contains metrics.jsonl\)"):
            ckpt.restore(like=state)
    with pytest.raises(CheckpointError, match=r"is one saved step, not a checkpoint directory; pass its parent"):
        CheckpointManager(root / "2", read_only=True)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        CheckpointManager(tmp_path / "nope", read_only=True)
    assert not (tmp_path / "nope").exists() and (run / "metrics.jsonl").read_text() == "{}\n"
    assert set(snapshot(run)) <= set(before)


def test_saving_an_existing_step_overwrites_nothing(saved_llama):
    root, state, _ = saved_llama
    before = snapshot(root)
    with CheckpointManager(root) as ckpt:
        with pytest.raises(CheckpointError, match=r"step 2 is already saved .* nothing was overwritten"):
            ckpt.save(2, state, force=True)
    assert snapshot(root) == before


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"save_every must be an int >= 1"):
        CheckpointManager("/tmp/unused", save_every=0)
    with pytest.raises(ValueError, match=r"keep_best mode must be one of \('min', 'max'\)"):
        CheckpointManager("/tmp/unused", keep_best=("eval_loss", "lowest"))


def test_leaves_that_cannot_be_saved_are_named(tmp_path):
    with CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(TypeError, match=r"leaf 'params.fn' is a builtin_function_or_method; a checkpoint holds tensors"):
            ckpt.save(1, {"params": {"fn": len}}, force=True)
        with pytest.raises(TypeError, match=r"data_state=\.\.\.\) must be JSON-serialisable"):
            ckpt.save(1, {"params": {"w": torch.ones(1)}}, data_state={"x": object()}, force=True)
    assert list(tmp_path.iterdir()) == []


# ---- sharding (single device) ------------------------------------------------------------------


class Recording:
    """A lowering that keeps tensors as they are and counts gathers and placements."""

    def __init__(self):
        self.gathered, self.placed = 0, []

    def place(self, x, spec):
        self.placed.append(spec)
        return x.clone()

    def constrain(self, x, spec):
        return x

    def local_shape(self, x):
        return tuple(x.shape)

    def gather(self, x):
        self.gathered += 1
        return x.detach().cpu()

    def context(self):
        import contextlib

        return contextlib.nullcontext()


def test_sharding_gathers_on_save_and_places_on_restore(tmp_path):
    model = build_model("llama3", "tiny", **LLAMA)
    state = TrainState.create(params=model.init(random.key(0)), tx=optim.adamw(1e-3))
    mesh = Mesh.parse("fsdp=1", backend="xla")
    sharding = Sharding(mesh, for_mesh(mesh.names), lowering=Recording())
    n = len([x for _, x in tree_leaves_with_path(state) if isinstance(x, torch.Tensor)])
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state, sharding=sharding)
        assert sharding.lowering.gathered == n
        with pytest.raises(TypeError, match=r"needs axes=model.axes"):
            ckpt.restore(like=state, sharding=sharding)
        restored, _, _ = ckpt.restore(like=state, sharding=sharding, axes=model.axes)
    assert len(sharding.lowering.placed) == n
    assert_bit_equal(restored, state)


def test_dtensor_state_on_a_one_process_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model("llama3", "tiny", **LLAMA)
        state = TrainState.create(params=model.init(random.key(0)), tx=optim.adamw(1e-3))
        mesh = Mesh.parse("dp=1", devices=1, backend="dtensor")
        sharding = Sharding(mesh, for_mesh(mesh.names))
        from ember.core.partition_specs import shard

        placed = shard(state, sharding, axes=model.axes)
        assert isinstance(placed.params["wte"]["weight"], DTensor)
        with CheckpointManager(tmp_path) as ckpt:
            with pytest.raises(TypeError, match=r"is a DTensor; pass sharding="):
                ckpt.save(1, placed)
            ckpt.save(1, placed, sharding=sharding)
            restored, _, _ = ckpt.restore(like=placed, sharding=sharding, axes=model.axes)
            with pytest.raises(TypeError, match=r"is a DTensor; pass sharding=\.\.\. and axes="):
                ckpt.restore(like=placed)
        assert isinstance(restored.params["wte"]["weight"], DTensor)
        assert_bit_equal(restored, placed)  # DTensor equality on one process compares the whole tensor
    finally:
        dist.destroy_process_group()
