"""Packed SFT windows against their documents run one by one, shared by the in-process and XLA tests.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 python tests/data/_packed_parity.py xla   # prints JSON

`run(family, backend)` computes the token-weighted loss and its gradients once on packed windows
(`pack_sft`: several documents a row, `segment_ids`, restarting positions; through `ember.core.jit`
on `backend`) and once document by document (eager, CPU), and returns the largest differences.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def examples(n: int = 7, seed: int = 0):
    """Random `(ids, learnt)` documents of 3..40 tokens, the second half of each learnt."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 41))
        ids = rng.integers(0, 256, length).astype(np.int32)
        out.append((ids, np.arange(length) >= length // 2))
    return out


def _one_by_one(model, params, docs):
    from ember.core.transforms import value_and_grad
    from ember.data.sft import IGNORE_INDEX
    from ember.models import lm_loss

    def mean(p):
        totals, counts = [], []
        for ids, learnt in docs:
            ids_t = torch.as_tensor(ids, dtype=torch.long)[None]
            targets = torch.where(torch.as_tensor(learnt[1:])[None], ids_t[:, 1:], IGNORE_INDEX)
            out = lm_loss(model)(p, {"inputs": ids_t[:, :-1], "targets": targets}, key=None)
            totals.append(out.total)
            counts.append(out.count)
        return torch.stack(totals).sum() / torch.stack(counts).sum()

    return value_and_grad(mean)(params)


def run(family: str, backend: str):
    from ember.core import pytree, random
    from ember.core.device import device_for, to_device
    from ember.core.jit import jit
    from ember.core.transforms import value_and_grad
    from ember.data.sft import pack_sft
    from ember.models import build_model, lm_loss

    model = build_model(family, "tiny")
    params = model.init(random.key(0))
    docs = examples()
    packed = {k: torch.as_tensor(v) for k, v in pack_sft(docs, seq_len=64).items()}
    assert packed["inputs"].shape[0] >= 2 and int(packed["segment_ids"].max()) >= 2  # several documents a row
    fn = value_and_grad(lambda p, batch: lm_loss(model)(p, batch, key=None).mean())
    device = device_for(backend)
    fn = fn if backend == "eager" else jit(fn, backend=backend)
    loss, grads = fn(to_device(params, device), to_device(packed, device))
    want_loss, want_grads = _one_by_one(model, params, docs)
    grad_diff = max(float((g.cpu() - w).abs().max()) for g, w in zip(pytree.tree_leaves(grads),
                                                                     pytree.tree_leaves(want_grads)))
    return {"loss": abs(float(loss.cpu()) - float(want_loss)), "grads": grad_diff}


if __name__ == "__main__":
    print(json.dumps({family: run(family, sys.argv[1]) for family in ("llama3", "qwen2")}))
