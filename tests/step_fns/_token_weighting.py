"""A masked-target case for token-weighted accumulation, shared by the in-process, XLA and mesh tests.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 python tests/step_fns/_token_weighting.py eager,xla   # prints JSON

`make_case(seed)` builds params and one batch of (B=8, T=6) tokens whose targets are randomly
ignored (`-100`), with rows 0-1 wholly ignored (with 4 microbatches, the first has no valid token)
and rows 4-7 mostly ignored (on a dp=2 mesh the two ranks hold different counts).
`run_step(backends, microbatches, ...)` runs one `train_step` with SGD(lr=1) on each backend, so the
parameter change is the gradient itself.
"""

from __future__ import annotations

import json
import sys

import torch

B, T, D, H, V = 8, 6, 5, 16, 7
SEEDS = (0, 1, 2)
MICROBATCHES = (1, 2, 4)


def loss_fn(params, batch, *, key):
    from ember.core.step_fns import cross_entropy

    logits = torch.tanh(batch["x"] @ params["w1"]) @ params["w2"]  # (b, T, V)
    return cross_entropy(logits, batch["y"], z_loss=1e-3, reduction="sum_and_count")


def make_case(seed: int):
    """(params, batch): the same on every process for the same seed."""
    from ember.core import random

    k1, k2, k3, k4, k5 = random.split(random.key(seed), 5)
    params = {"w1": random.normal(k1, (D, H)) * 0.5, "w2": random.normal(k2, (H, V)) * 0.5}
    x = random.normal(k3, (B, T, D))
    y = random.randint(k4, (B, T), 0, V)
    keep = random.uniform(k5, (B, T)) < torch.tensor([0.0, 0.0, 0.9, 0.9, 0.2, 0.2, 0.2, 0.2]).unsqueeze(1)
    return params, {"x": x, "y": torch.where(keep, y, torch.full_like(y, -100))}


def run_step(backends, microbatches: int, params, batch):
    """One SGD(lr=1) step on each backend (compared with each other by `run_on_backends`).

    Returns `{backend: (loss, tokens, grads)}` on CPU, grads = params - new params.
    """
    from ember import optim
    from ember.core import TrainState, random
    from ember.core.step_fns import train_step
    from ember.core.testing import run_on_backends

    state = TrainState.create(params=params, tx=optim.sgd(1.0), key=random.key(9))
    step = train_step(loss_fn, microbatches=microbatches)
    out = run_on_backends(step, state, batch, backends=backends, rtol=1e-5, atol=1e-6)
    return {
        name: (float(ms[0]["loss"]), float(ms[0]["tokens"]), {k: params[k] - final.params[k] for k in params})
        for name, (final, ms) in out.items()
    }


def main(backends) -> None:
    """Print `{"seed/microbatches": {backend: {loss, tokens, grads}}}` as one JSON line."""
    out = {}
    for seed in SEEDS:
        params, batch = make_case(seed)
        for m in MICROBATCHES:
            per_backend = run_step(backends, m, params, batch)
            out[f"{seed}/{m}"] = {
                name: {"loss": loss, "tokens": tokens, "grads": {k: g.tolist() for k, g in grads.items()}}
                for name, (loss, tokens, grads) in per_backend.items()
            }
    print(json.dumps(out))


if __name__ == "__main__":
    main(tuple(sys.argv[1].split(",")))
