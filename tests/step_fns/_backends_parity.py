"""Subprocess body of test_backends_parity.py: one pure train_step on eager, inductor and xla.

A 1-layer Llama (GQA, RoPE, SwiGLU, dropout 0.1) with AdamW, clipping and a warmup-cosine
learning rate, 20 steps on fixed random batches. Prints one JSON line with the loss trajectory and
compile counts of each backend. Run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=1.
"""

import json

import torch
import torch_xla

from ember.core import TrainState, jit, random, xla
from ember.optim.config import OptimConfig
from ember.core.device import to_device
from ember.core.step_fns import train_step
from ember.models import build_model, lm_loss
from ember.optim.config import from_config

STEPS = 20
dev = torch_xla.device()  # start the XLA runtime before any backward pass (see core/jit.py)
model = build_model("llama3", "tiny", n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
model = build_model("llama3", model.config.replace(vocab_size=64))
step_fn = train_step(lm_loss(model))
tx = from_config(OptimConfig(learning_rate=3e-3, warmup_steps=5), total_steps=STEPS)
# A learnable task: the next token is the current one plus one (mod 64).
inputs = [random.randint(random.key(100 + i), (4, 32), 0, 64) for i in range(STEPS)]
batches = [{"inputs": x, "targets": (x + 1) % 64} for x in inputs]


def run(backend, device):
    state = to_device(TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1)), device)
    step = jit(step_fn, backend=backend, donate="state")
    losses, new_compiles = [], []
    for i, batch in enumerate(batches):
        before = step.compile_count
        state, metrics = step(state, to_device(batch, device))
        new_compiles.append(step.compile_count - before)
        losses.append(metrics["loss"])
    return {"losses": [float(x) for x in losses], "compiles_per_step": new_compiles}


result = {b: run(b, "cpu" if b != "xla" else dev) for b in ("eager", "inductor", "xla")}
result["xla_total_compiles"] = xla.compile_count()
print(json.dumps(result))
