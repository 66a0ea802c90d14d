"""ember.core.random under torch_xla: integer hashing is exact, so bits, uniform and dropout match
the CPU numbers bit for bit; normal matches to float32 rounding. Runs in a subprocess because the
torch_xla device count is fixed when its runtime starts."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, torch, torch_xla
    from ember.core import random

    def draws(k):
        k1, k2 = random.split(k)
        return [random.bits(k1, (185,)), random.uniform(k1, (37, 5)),
                random.dropout(k2, torch.ones(37, 5, device=k.device), 0.5), random.normal(k2, (37, 5))]

    cpu = draws(random.key(7))
    dev = torch_xla.device()
    xla = draws(random.key(7, device=dev))
    torch_xla.sync()
    xla = [t.cpu() for t in xla]
    again = [t.cpu() for t in draws(random.key(7, device=dev))]
    print(json.dumps({
        "exact": [bool(torch.equal(a, b)) for a, b in zip(cpu[:3], xla[:3])],
        "normal_max_diff": float((cpu[3] - xla[3]).abs().max()),
        "repeatable": all(bool(torch.equal(a, b)) for a, b in zip(xla, again)),
    }))
    """
)


@pytest.mark.xla
def test_random_on_xla_matches_cpu():
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exact"] == [True, True, True], result
    assert result["normal_max_diff"] < 1e-5, result
    assert result["repeatable"], result
