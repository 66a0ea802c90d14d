"""A compiled step is a pure function, bit for bit: repeated calls on the same state and batch give
`torch.equal` outputs on a multi-threaded CPU (an embedding's backward, dropout and keys included).

Runs in a fresh process with 2 threads and without the suite's global deterministic setting, so
only `jit`'s own scoped setting is in force.
"""

import json
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(2)
    from ember import optim
    from ember.core import TrainState, jit, random
    from ember.core.step_fns import cross_entropy, train_step
    from ember.core.pytree import tree_leaves
    from ember.models import build_model

    deterministic = sys.argv[1] == "1"
    model = build_model("gpt2", "tiny", dropout=0.1, vocab_size=512)
    tx = optim.adamw(1e-3)
    start = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))

    def loss_fn(params, batch, *, key):
        return cross_entropy(model.apply(params, batch["inputs"], key=key), batch["targets"])

    step = jit(train_step(loss_fn), deterministic=deterministic)
    g = torch.Generator().manual_seed(0)
    batch = {"inputs": torch.randint(0, 512, (8, 64), generator=g),
             "targets": torch.randint(0, 512, (8, 64), generator=g)}
    first = None
    differing = 0
    for _ in range(12):
        leaves = [t for t in tree_leaves(step(start, batch)) if isinstance(t, torch.Tensor)]
        if first is None:
            first = leaves
        else:
            differing += any(not torch.equal(a, b) for a, b in zip(first, leaves))
    print(json.dumps({"differing_calls": differing, "compiles": step.compile_count}))
""")


def _run(deterministic: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, deterministic], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_repeated_calls_of_a_compiled_step_give_the_same_bits():
    got = _run("1")
    assert got == {"differing_calls": 0, "compiles": 1}, got
