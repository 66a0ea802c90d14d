"""JAX stays off the accelerator: a CheckpointManager pins it to the CPU before any JAX backend starts,
unless the user chose JAX's platforms (JAX_PLATFORMS is respected)."""

import json
import os
import signal
import subprocess
import sys

SCRIPT = """
import json, sys, torch
from ember.core.checkpoint import CheckpointManager
with CheckpointManager(sys.argv[1], async_save=False) as ckpt:
    ckpt.save(1, {"params": {"w": torch.ones(2)}})
import jax, os
print(json.dumps({"platform": jax.devices()[0].platform, "env": os.environ.get("JAX_PLATFORMS")}))
"""


def _run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_checkpoint_manager_pins_jax_to_the_cpu(tmp_path):
    assert _run(tmp_path) == {"platform": "cpu", "env": "cpu"}


def test_the_users_jax_platforms_is_kept(monkeypatch):
    from ember.core.checkpoint._jax_platform import keep_jax_on_cpu

    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    keep_jax_on_cpu()
    assert os.environ["JAX_PLATFORMS"] == "cuda,cpu"
