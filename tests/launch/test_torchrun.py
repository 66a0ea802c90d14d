"""The README's torchrun commands as written, only shorter: `launch/train.py --mesh fsdp=2` under
`torchrun --nproc-per-node 2` with the default backend (compiled by Inductor), over gloo, against
the same run in one process; its compiled all-gathers leave the host heap whole
(`core/compat/gloo_all_gather.py`: before that patch such a run aborted a rank about every second time)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from ember.launch.metrics_log import read_metrics

pytestmark = pytest.mark.xdist_group("torchrun")  # one worker runs the module: its shared fixture runs once

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHORT = ["--steps", "3", "--model.n_layers", "1", "--data.max_bytes", "300000", "--log_every", "1",
         "--eval_batches", "1", "--sample_tokens", "8"]


def _env() -> dict:
    """This process's environment without torch_xla's variables (an earlier XLA test in the same
    worker may have set them; `Mesh.parse` would then pick the XLA backend), one thread a rank, no GPU
    (gloo ranks on the CPU, also on a host with fewer GPUs than ranks)."""
    xla = {"PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS"}
    return {**{k: v for k, v in os.environ.items() if k not in xla}, "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


def _train(out: pathlib.Path, *prefix: str, mesh=()) -> list:
    env = _env()
    cmd = [*prefix, str(ROOT / "launch" / "train.py"), *mesh, *SHORT, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "malloc()" not in proc.stderr, proc.stderr[-6000:]  # 'malloc(): unaligned tcache chunk detected'
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("single") / "run", sys.executable)


# fsdp=2 on two processes: four cold compiles on CI's two cores cost minutes on every torch line (VERSION_TESTS).
# The compiled fsdp=2,tp=2 launch against one process is test_torchrun_moe.py's (dense attention split over tp, the
# experts grouped); the four-process README snippet below runs eagerly.
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["fsdp=2"])
def test_launcher_under_torchrun_compiles_and_matches_one_process(tmp_path, one_process, mesh):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    losses = _train(tmp_path / "run", *torchrun, mesh=["--mesh", mesh])
    assert len(losses) == len(one_process) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_process), rtol=0, atol=2e-4)



def _first_python_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.mark.slow
def test_readme_in_a_script_snippet_under_torchrun(tmp_path):
    """'Composing a step' then 'In a script', as written but eager, on 4 gloo processes. Four cold compiles of
    the dense `fsdp=2,tp=2` step took 264 s on 2 cores; the compiled DTensor step on that mesh is the MoE
    launch's (its attention split over tp, tests/launch/test_torchrun_moe.py)."""
    readme = (ROOT / "README.md").read_text()
    composing = _first_python_block(readme.split("## Composing a step", 1)[1])
    assert 'backend="inductor"' in composing
    script = (composing.replace('backend="inductor"', 'backend="eager"')
              + _first_python_block(readme.split("In a script:", 1)[1])
              + "import math\n"
              + "assert all(math.isfinite(float(v.full_tensor())) for v in metrics.values()), metrics\n"
              + "print('SNIPPET_OK')\n"
              # the launcher's teardown: every rank arrives, then the group closes before exit (a rank that
              # tore gloo down while a peer still held its end once died after SNIPPET_OK)
              + "from ember.launch.sharded import teardown\nteardown(finished=True)\n")
    (tmp_path / "snippet.py").write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(tmp_path / "snippet.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert proc.stdout.count("SNIPPET_OK") == 4
