"""`train_step` under torch_xla matches eager, checked through `ember.core.testing.run_on_backends`.

Runs in a subprocess: the torch_xla device count is fixed when its runtime starts.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from ember import optim
    from ember.core import TrainState, random
    from ember.core.step_fns import cross_entropy, train_step
    from ember.core.testing import run_on_backends

    calls = []

    def loss_fn(params, batch, *, key):
        calls.append(batch["x"].device.type)
        h = random.dropout(key, torch.tanh(batch["x"] @ params["w1"]), 0.25)  # (B, 16)
        return cross_entropy(h @ params["w2"], batch["y"])                    # (B, 4) logits

    k1, k2 = random.split(random.key(0))
    params = {"w1": random.normal(k1, (8, 16)) * 0.3, "w2": random.normal(k2, (16, 4)) * 0.3}
    state = TrainState.create(params=params, tx=optim.adamw(1e-2, weight_decay=0.1), key=random.key(1))
    batches = [{"x": random.normal(random.key(10 + i), (8, 8)),
                "y": random.randint(random.key(20 + i), (8,), 0, 4)} for i in range(3)]
    batches[2]["x"][0, 0] = float("nan")  # the skip path must agree too
    out = run_on_backends(train_step(loss_fn, microbatches=4), state, batches,
                          backends=("eager", "xla"), rtol=1e-5, atol=1e-6)
    final, metrics = out["xla"]
    print(json.dumps({"losses": [m["loss"].item() for m in metrics],
                      "skipped": [m["skipped"].item() for m in metrics],
                      "step": int(final.step), "skipped_steps": int(final.skipped_steps),
                      "xla_traces_of_loss_fn": calls.count("xla")}))
    """
)


@pytest.mark.xla
def test_train_step_on_xla_matches_eager():
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["skipped"] == [0.0, 0.0, 1.0] and result["skipped_steps"] == 1, result
    assert result["step"] == 3, result
    # 4 microbatches: the first is traced inline, the other three are one While body (per step).
    assert result["xla_traces_of_loss_fn"] == 3 * 2, result
