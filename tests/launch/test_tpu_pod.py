"""launch/tpu_pod.py end to end on virtual CPU devices: the re-run on `mesh size` devices, the
sharding report, training, and the check against the single-device reference."""

import importlib.util
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group("tpu_pod")  # one worker runs the module: its shared fixture runs once

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "tpu_pod.py"
TINY = ["--steps", "3", "--data.batch_size", "8", "--data.seq_len", "32", "--data.max_bytes", "300000",
        "--model.n_layers", "2"]


def _run(args, **env):
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla], or make install)")
    base = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env={**base, **env}, capture_output=True, text=True,
                          timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def pod_run(tmp_path_factory):
    # its own --out: under xdist two workers may each run this fixture, and the run config's own out
    # (runs/default) takes one run at a time
    return _run(["--mesh", "dp=2,tp=2", *TINY, "--out", str(tmp_path_factory.mktemp("pod") / "run")])


@pytest.mark.xla
def test_simulates_the_mesh_on_virtual_cpu_devices(pod_run):
    rc, out, err = pod_run
    assert rc == 0, err[-4000:]
    assert "simulating on 4 virtual CPU devices (PJRT_DEVICE=CPU CPU_NUM_DEVICES=4)" in out
    assert "mesh dp=2,tp=2 (4 devices, xla), layout fsdp_tp" in out


@pytest.mark.xla
def test_prints_each_parameters_sharding_and_memory(pod_run):
    out = pod_run[1]
    # llama3_tiny: d_model 192, ffn 512; tp=2 splits the MLP's hidden dimension.
    assert re.search(r"^blocks\.mlp\.gate\.weight\s+\(\d+, 512, 192\)\s+\(None, 'tp', None\)\s+\(\d+, 256, 192\)$", out, re.M)
    assert re.search(r"^per device: params [\d.]+ MiB of [\d.]+ MiB, optimizer state", out, re.M)


@pytest.mark.xla
def test_trains_and_matches_the_single_device_reference(pod_run):
    out = pod_run[1]
    assert [int(c) for c in re.findall(r"^step \d+: loss [\d.]+, compiled (\d+)$", out, re.M)] == [1, 0, 0]
    diff = float(re.search(r"max \|loss - single-device loss\| = (\S+) over 3 steps", out).group(1))
    assert diff < 1e-4 and "check passed" in out


@pytest.mark.xla
@pytest.mark.parametrize("mesh", ["dp=3", "dp=5"])
def test_a_mesh_that_does_not_fit_the_devices_names_the_fix(mesh):
    rc, out, err = _run(["--mesh", mesh, *TINY], PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: mesh '{mesh}' needs {mesh[3:]} devices but 4 are available")
    assert "--mesh dp=4" in err


@pytest.mark.xla
def test_a_second_pod_run_into_the_same_out_is_refused(tmp_path):
    from ember.launch.run_dir import LOCK_FILE

    out = tmp_path / "pod"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / LOCK_FILE).write_text(f"{holder.pid} {socket.gethostname()}\n")
        rc, _, err = _run(["--mesh", "dp=2", "--out", str(out), *TINY], PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2 and f"is in use by process {holder.pid}" in err


@pytest.mark.xla
def test_help_lists_the_pod_flags_and_the_configs():
    rc, out, _ = _run(["--help"])
    assert rc == 0 and "--check, --no-check" in out and "--resume_step N" in out and "llama3_tiny" in out


@pytest.mark.xla
def test_checkpoints_and_resumes_where_it_stopped(tmp_path):
    import shutil

    args = ["--mesh", "fsdp=2", *TINY, "--steps", "4", "--out", str(tmp_path), "--checkpoint_every", "2",
            "--keep", "0"]
    rc, out, err = _run(args)
    assert rc == 0, err[-4000:]
    straight = dict(re.findall(r"^step (\d+): loss ([\d.]+)", out, re.M))
    shutil.rmtree(tmp_path / "checkpoints" / "4")  # as if the pod was preempted before the last save
    rc, out, err = _run([*args, "--resume"])
    assert rc == 0, err[-4000:]
    assert "resumed from step 2" in out
    resumed = dict(re.findall(r"^step (\d+): loss ([\d.]+)", out, re.M))
    assert sorted(resumed) == ["3", "4"] and all(resumed[s] == straight[s] for s in resumed), (resumed, straight)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """`--mesh pp=2` on 2 virtual devices, XLA's optimized HLO dumped beside the run."""
    root = tmp_path_factory.mktemp("pod_pp")
    args = ["--mesh", "pp=2", *TINY, "--model.scan_layers", "true", "--pipeline_microbatches", "4",
            "--out", str(root / "run")]
    rc, out, err = _run(args, XLA_FLAGS=f"--xla_dump_to={root / 'hlo'} --xla_dump_hlo_as_text")
    return rc, out, err, root / "hlo"


@pytest.mark.xla
def test_pipeline_stages_train_as_one_device_with_the_shift_a_collective_permute(pipeline_run):
    """Two stages of one layer, 4 microbatches of 2 sequences (32 tokens, d=192): the step's HLO moves one
    stage's buffer by collective-permute, forward and backward, and never gathers the stage buffer."""
    import glob

    sys.path.insert(0, str(ROOT / "tests" / "partition_specs"))
    from _xla_comm_hlo import count_collectives

    rc, out, err, hlo = pipeline_run
    assert rc == 0, err[-4000:]
    assert "check passed" in out
    assert "pipeline: 2 stages of 1 layers (of 2), 4 microbatches x 1 repeat(s), bubble 20.0%" in out  # the report
    assert [int(c) for c in re.findall(r"^step \d+: loss [\d.]+, compiled (\d+)$", out, re.M)] == [1, 0, 0]
    step = max(glob.glob(str(hlo / "*SyncTensorsGraph*after_optimizations.txt")), key=os.path.getsize)
    found = count_collectives(open(step).read())
    stage = "f32[1,2,32,192]"  # one stage's slot of the buffer: (local stages, microbatch, tokens, width)
    assert sum(s.startswith(stage) for s in found.get("collective-permute", [])) >= 2 * (4 + 2 - 1)
    assert not [s for s in found.get("all-gather", []) if s.startswith("f32[2,2,32,192]")]  # the buffer stays split


@pytest.mark.xla
@pytest.mark.parametrize("mesh,model", [("pp=2,fsdp=2", []), ("pp=2,tp=2", []),
                                        ("pp=2,ep=2", ["--config", "qwen3_moe_tiny"])])
def test_pipeline_stages_beside_fsdp_tp_or_ep_train_as_one_device(tmp_path, mesh, model):
    """Beside `ep`, a Qwen3-MoE's stages hold their layers' share of the experts and its router statistics
    are summed over the microbatches (the auxiliary loss as one device's)."""
    rc, out, err = _run([*model, "--mesh", mesh, *TINY, "--model.scan_layers", "true", "--pipeline_microbatches", "4",
                         "--out", str(tmp_path / "run")])
    assert rc == 0, err[-4000:]
    assert "check passed" in out
    if model:
        assert re.search(r"^blocks\.mlp\.gate\s+\(2, 8, 128, 192\)\s+\('pp', 'ep', None, None\)\s+\(1, 4, 128, 192\)$",
                         out, re.M)
    assert [int(c) for c in re.findall(r"^step \d+: loss [\d.]+, compiled (\d+)$", out, re.M)] == [1, 0, 0]


@pytest.mark.xla
@pytest.mark.parametrize("mesh", ["cp=2", "cp=2,tp=2", "pp=2,cp=2,fsdp=2"])
def test_context_parallel_trains_as_one_device(tmp_path, mesh):
    """The sequence split over cp (each in its head-tail order), beside tp, and with pipeline stages and fsdp on
    8 virtual devices: every loss within 1e-4 of one device's, one compile; under cp=2 the step's only
    all-gathers are of the keys and values, `(B, KV, T, D)` whole (the grouped-query heads repeated after),
    and of the keys' token indices (ints)."""
    import glob

    sys.path.insert(0, str(ROOT / "tests" / "partition_specs"))
    from _xla_comm_hlo import count_collectives

    stages = ["--model.scan_layers", "true", "--pipeline_microbatches", "4"] if "pp" in mesh else []
    rc, out, err = _run(["--mesh", mesh, *TINY, *stages, "--out", str(tmp_path / "run")],
                        XLA_FLAGS=f"--xla_dump_to={tmp_path / 'hlo'} --xla_dump_hlo_as_text")
    assert rc == 0, err[-4000:]
    assert "check passed" in out
    assert [int(c) for c in re.findall(r"^step \d+: loss [\d.]+, compiled (\d+)$", out, re.M)] == [1, 0, 0]
    if mesh == "cp=2":
        step = max(glob.glob(str(tmp_path / "hlo" / "*SyncTensorsGraph*after_optimizations.txt")), key=os.path.getsize)
        gathered = count_collectives(open(step).read()).get("all-gather", [])
        keys = [s for s in gathered if s.startswith("f32[8,2,32,32]")]  # (B, KV, T, D): 2 KV heads, not 6 repeated
        assert len(keys) == 2 * 2, gathered  # keys and values, each of the 2 layers
        assert all(s.startswith(("f32[8,2,32,32]", "s64[8,32]")) for s in gathered), gathered
