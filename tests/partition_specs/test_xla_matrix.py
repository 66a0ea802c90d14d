"""torch_xla SPMD lowering (`core/partition_specs/xla.py`) and the sharding report (`report.py`).

The matrix: a tiny Llama + AdamW (with clipping) trained 10 steps under `jit(backend="xla")` on
virtual CPU devices, for meshes dp=2, tp=2 (2 devices) and fsdp=4, dp=2,tp=2, fsdp=2,tp=2
(4 devices), each against the single-device eager reference with the same init and batches. A
torch_xla mesh must cover every device (`xs.Mesh` asserts it), so each device count is its own
subprocess (`_xla_matrix_worker.py`), started together; one more (`_xla_spmd_late.py`) checks
the error for SPMD requested after the runtime started. The report tests at the end need no
devices.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from ember.core import TrainState
from ember.core.mesh import Mesh, MeshError
from ember.core.partition_specs import PartitionSpec as P
from ember.core.partition_specs import ShardingRuleError, data_parallel
from ember.core.partition_specs.report import describe_sharding, local_shape_of, memory_per_device, sharding_table
from ember.core.partition_specs.xla import dcn_split, partition_tuple
from ember.models import build_model
from ember.optim import adamw

pytestmark = pytest.mark.xdist_group("xla_matrix")  # one worker runs the module: its shared fixture runs once

HERE = pathlib.Path(__file__).parent
LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16)
STEPS = 10
LOSS_TOL = 1e-4  # float32; XLA fuses and reorders the same ops and GSPMD splits reductions (observed <= 1e-6)
MESHES = {2: ["dp=2", "tp=2"], 4: ["fsdp=4", "dp=2,tp=2", "fsdp=2,tp=2"]}
ALL_MESHES = [m for ms in MESHES.values() for m in ms]

# V=64 vocab, d=32, H*D=32 (heads), KV*D=16 (kv_heads), F=64 (mlp), 2 stacked layers: the shard one device holds.
EXPECTED_LOCAL = {
    "dp=2": {"wte.weight": (64, 32), "blocks.attn.wq.weight": (2, 32, 32), "blocks.attn.wk.weight": (2, 16, 32),
             "blocks.attn.wo.weight": (2, 32, 32), "blocks.mlp.gate.weight": (2, 64, 32),
             "blocks.mlp.down.weight": (2, 32, 64), "blocks.ln_1.weight": (2, 32)},
    "tp=2": {"wte.weight": (32, 32), "blocks.attn.wq.weight": (2, 16, 32), "blocks.attn.wk.weight": (2, 8, 32),
             "blocks.attn.wo.weight": (2, 32, 16), "blocks.mlp.gate.weight": (2, 32, 32),
             "blocks.mlp.down.weight": (2, 32, 32), "blocks.ln_1.weight": (2, 32)},
    "fsdp=4": {"wte.weight": (64, 8), "blocks.attn.wq.weight": (2, 32, 8), "blocks.attn.wk.weight": (2, 16, 8),
               "blocks.attn.wo.weight": (2, 8, 32), "blocks.mlp.gate.weight": (2, 64, 8),
               "blocks.mlp.down.weight": (2, 8, 64), "blocks.ln_1.weight": (2, 8)},
    "fsdp=2,tp=2": {"wte.weight": (32, 16), "blocks.attn.wq.weight": (2, 16, 16), "blocks.attn.wk.weight": (2, 8, 16),
                    "blocks.attn.wo.weight": (2, 16, 16), "blocks.mlp.gate.weight": (2, 32, 16),
                    "blocks.mlp.down.weight": (2, 16, 32), "blocks.ln_1.weight": (2, 16)},
}
EXPECTED_LOCAL["dp=2,tp=2"] = EXPECTED_LOCAL["tp=2"]  # dp splits only the batch


def _env(n):
    return dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(n))


@pytest.fixture(scope="module")
def runs():
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla], or make install)")
    procs = {n: subprocess.Popen([sys.executable, str(HERE / "_xla_matrix_worker.py"), *meshes], env=_env(n),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, meshes in MESHES.items()}
    procs["late"] = subprocess.Popen([sys.executable, str(HERE / "_xla_spmd_late.py")], env=_env(2),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"worker {name} failed (rc {proc.returncode}):\n{stderr[-4000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


def _mesh_run(runs, mesh):
    n = next(n for n, ms in MESHES.items() if mesh in ms)
    return runs[n], runs[n]["meshes"][mesh]


@pytest.mark.xla
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_loss_trajectory_matches_single_device(runs, mesh):
    proc, run = _mesh_run(runs, mesh)
    assert len(run["losses"]) == STEPS
    assert run["losses"] == pytest.approx(proc["eager_losses"], abs=LOSS_TOL)
    assert run["param_diff"] < LOSS_TOL, f"params after {STEPS} steps differ by {run['param_diff']}"


@pytest.mark.xla
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_step_compiles_once(runs, mesh):
    """The state keeps its shardings across steps, so the step's graph (and its hash) never changes."""
    assert _mesh_run(runs, mesh)[1]["per_step_compiles"] == [1] + [0] * (STEPS - 1)


@pytest.mark.xla
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_local_shard_shapes_follow_the_rules(runs, mesh):
    local = _mesh_run(runs, mesh)[1]["local"]
    for path, shape in EXPECTED_LOCAL[mesh].items():
        assert tuple(local[path]) == shape, f"{mesh}: {path} holds {local[path]} per device, expected {shape}"


@pytest.mark.xla
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_report_predicts_every_shard_shape_the_device_holds(runs, mesh):
    """`report.sharding_table` (arithmetic on specs) == torch_xla's shards, for params and optimizer state."""
    run = _mesh_run(runs, mesh)[1]
    actual = {**run["local"], **run["opt_local"]}
    assert set(actual) <= set(run["predicted"])
    wrong = {k: (v, run["predicted"][k]) for k, v in actual.items() if v != run["predicted"][k]}
    assert not wrong, f"{mesh}: device vs predicted local shapes differ: {wrong}"


@pytest.mark.xla
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_adam_moments_inherit_their_parameter_sharding(runs, mesh):
    run = _mesh_run(runs, mesh)[1]
    moments = {k: v for k, v in run["opt_local"].items() if ".mu." in k or ".nu." in k}
    assert len(moments) == 2 * len(run["local"])
    for path, shape in moments.items():
        param = path.split(".mu.", 1)[-1].split(".nu.", 1)[-1]
        assert shape == run["local"][param], f"{mesh}: {path} is {shape}, its parameter {param} {run['local'][param]}"
    scalars = [v for k, v in run["opt_local"].items() if k not in moments]
    assert scalars and all(v == [] for v in scalars)  # counts and hyperparameters: 0-d, replicated


@pytest.mark.xla
def test_report_on_the_xla_sharding(runs):
    report = _mesh_run(runs, "fsdp=2,tp=2")[1]["report"]
    lines = report.splitlines()
    assert lines[0] == "mesh fsdp=2,tp=2 (4 devices, xla), layout fsdp_tp"
    gate = next(line for line in lines if line.startswith("blocks.mlp.gate.weight"))
    assert gate.split()[1:] == ["(2,", "64,", "32)", "(None,", "'tp',", "'fsdp')", "(2,", "32,", "16)"]
    assert lines[-1].startswith("per device: params 20.31 KiB of 80.62 KiB, optimizer state 40.66 KiB of")


@pytest.mark.xla
def test_mesh_must_match_the_device_count(runs):
    kind, msg = runs[2]["behaviour"]["wrong_size"]
    assert kind == "MeshError" and "needs 4 devices but 2 are available" in msg


@pytest.mark.xla
def test_place_constrain_gather_edge_cases(runs):
    b = runs[4]["behaviour"]
    assert b["cpu_constrain_is_identity"] is True  # a CPU tensor (e.g. made outside the step) passes through
    assert b["place_local"] == [[2, 2], [8, 2]]  # re-placing an XLA tensor replicated: a copy, not in place
    assert b["place_roundtrip"] is True
    kind, msg = b["bad_rank"]
    assert kind == "ShardingRuleError" and "has 1 entries but the tensor has 2 dimensions" in msg


@pytest.mark.xla
def test_spmd_after_the_runtime_started_is_a_clear_error(runs):
    kind, msg = runs["late"]["error"]
    assert kind == "RuntimeError"
    assert "before the torch_xla runtime starts" in msg and "shape (3, 5)" in msg and "Build the Sharding" in msg


# ---- no devices needed -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,slices,want",
    [((8, 4), 1, ((8, 4), (1, 1))), ((8, 4), 2, ((4, 4), (2, 1))), ((2, 2, 4), 4, ((1, 1, 4), (2, 2, 1))),
     ((6, 4), 4, ((3, 2), (2, 2)))],
    ids=["one-slice", "dp-over-dcn", "two-outer-axes", "spills-inward"],
)
def test_dcn_split_puts_slices_on_the_outer_axes(shape, slices, want):
    assert dcn_split(shape, slices) == want


def test_dcn_split_refuses_slices_that_do_not_divide():
    with pytest.raises(MeshError, match="cannot be spread over 3 slices"):
        dcn_split((8, 4), 3)


def test_partition_tuple_is_the_spec_checked():
    assert partition_tuple(P(("dp", "fsdp"), None), ("dp", "fsdp", "tp"), ndim=2) == (("dp", "fsdp"), None)
    with pytest.raises(ShardingRuleError, match="names mesh axis 'pp'"):
        partition_tuple(P("pp", None), ("dp", "tp"), ndim=2)
    with pytest.raises(ShardingRuleError, match="uses mesh axis 'tp' for two dimensions"):
        partition_tuple(P("tp", "tp"), ("dp", "tp"), ndim=2)


@pytest.fixture(scope="module")
def tiny():
    model = build_model("llama3", "tiny", **LLAMA)
    state = TrainState.create(params=model.param_shapes(), tx=adamw(1e-2))  # meta tensors: nothing allocated
    return model, state


@pytest.mark.parametrize("mesh,matrix_parts,norm_parts", [("dp=2", 1, 1), ("fsdp=4", 4, 4), ("fsdp=2,tp=2", 4, 2),
                                                           ("tp=2", 2, 1)])
def test_memory_per_device_from_specs_alone(tiny, mesh, matrix_parts, norm_parts):
    """Matrices split over every axis of the mesh but dp; the norms (embed only) over fsdp alone."""
    model, state = tiny
    rows = sharding_table(state, Mesh.parse(mesh, backend="xla"), axes=model.axes)
    mem = memory_per_device(rows)
    assert mem.full_params == sum(t.numel() * 4 for t in torch.utils._pytree.tree_leaves(state.params))
    norms = 5 * LLAMA["d_model"] * 4  # ln_1, ln_2 per layer + ln_f, float32
    assert mem.params == (mem.full_params - norms) // matrix_parts + norms // norm_parts
    assert 0 <= mem.optimizer - 2 * mem.params <= 64  # mu and nu shard like their parameters; + a few scalars
    assert mem.total == mem.params + mem.optimizer + mem.other and mem.full_total > mem.total * (matrix_parts > 1)


def test_describe_sharding_lists_parameters_and_optimizer_state(tiny):
    model, state = tiny
    text = describe_sharding(state, Mesh.parse("fsdp=4", backend="dtensor"), axes=model.axes, show_optimizer=True)
    lines = text.splitlines()
    assert lines[0] == "mesh fsdp=4 (4 devices, dtensor), layout fsdp_tp"
    assert lines[1].split() == ["tensor", "shape", "spec", "local", "shape"]
    assert any(line.startswith("opt_state.inner_state.0.mu.blocks.mlp.up.weight") and line.endswith("(2, 64, 8)") for line in lines)
    param_rows = [line for line in lines[2:-1] if not line.startswith("opt_state")]
    assert len(param_rows) == len(torch.utils._pytree.tree_leaves(state.params))


def test_report_takes_a_layout_and_counts_a_tied_tensor_once():
    w = torch.empty(8, 4, device="meta")
    tree = {"a": w, "b": w}
    rows = sharding_table(tree, Mesh.parse("dp=2", backend="xla"), axes={"a": ("vocab", "embed"), "b": ("vocab", "embed")},
                          layout=data_parallel())
    assert [r.path for r in rows] == ["a"] and rows[0].local_bytes == 8 * 4 * 4


def test_report_rejects_other_sharding_arguments():
    with pytest.raises(TypeError, match="expects a Sharding or a Mesh"):
        describe_sharding({}, "dp=2", axes={})


def test_local_shape_of_rounds_up_like_xla_padding():
    assert local_shape_of((10, 3), P("tp", None), {"tp": 4}) == (3, 3)


# ---- collectives of one Llama block (see /work/notes/comm_xla.md) -------------------------------


@pytest.fixture(scope="module")
def comm():
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla], or make install)")
    spec = importlib.util.spec_from_file_location("_xla_comm_hlo", HERE / "_xla_comm_hlo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_all()


@pytest.mark.xla
@pytest.mark.slow
def test_block_collectives_follow_the_layout(comm):
    """What GSPMD emits for one block (d=64, F=256, B*T=128): DDP gradient all-reduces, FSDP
    per-weight all-gathers, Megatron's two forward all-reduces of the residual stream."""
    n_weights = 9  # ln_1, wq, wk, wv, wo, ln_2, gate, up, down
    dp, fsdp, tp = comm["dp=2"], comm["fsdp=4"], comm["tp=2"]
    assert dp["forward"] == {"all-reduce": ["f32[]"]}  # only the loss mean crosses devices
    assert sorted(dp["forward+backward"]) == ["all-reduce"]
    assert len(dp["forward+backward"]["all-reduce"]) == n_weights + 1  # one per gradient, + the loss
    assert len(fsdp["forward"]["all-gather"]) == n_weights  # each weight gathered once, before its use
    assert fsdp["forward+backward"]["all-gather"] == fsdp["forward"]["all-gather"]  # no re-gather in backward
    assert tp["forward"]["all-reduce"] == ["f32[128,64]{1,0}"] * 2  # after wo and after down (row parallel)
