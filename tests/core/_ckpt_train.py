"""A tiny GPT-2 run (dropout on, AdamW with warm-up + clipping, stdlib corpus) for the checkpoint
tests; imported by tests/core/test_checkpoint_resume.py and by the worker scripts beside it.

    python tests/core/_ckpt_train.py resume CKPT_DIR STEPS OUT.pt [--workers N] [--backend eager]

restores the latest checkpoint in CKPT_DIR into a fresh process, trains up to STEPS and writes the
final state's leaves and every loss to OUT.pt (the "stop the process, resume" half of the test).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, List, Tuple

import torch

from ember import data, optim
from ember.core import TrainState, random
from ember.data.config import DataConfig
from ember.optim.config import OptimConfig
from ember.core.jit import jit
from ember.core.pytree import tree_leaves_with_path
from ember.core.step_fns import train_step
from ember.models import build_model, lm_loss

TOTAL_STEPS = 6
MODEL = dict(vocab_size=320, max_seq_len=32, n_layers=1, n_heads=2, d_model=32, dropout=0.1)


@dataclasses.dataclass
class Setup:
    model: Any
    tx: Any
    data_cfg: DataConfig
    tokenizer: Any


def setup(*, num_workers: int = 0) -> Setup:
    model = build_model("gpt2", "tiny", **MODEL)
    tx = optim.from_config(OptimConfig(warmup_steps=2, clip_norm=1.0), total_steps=TOTAL_STEPS)
    data_cfg = DataConfig(max_bytes=40_000, seq_len=16, batch_size=4, num_workers=num_workers, seed=3)
    return Setup(model, tx, data_cfg, data.build_tokenizer(data_cfg))


def fresh_state(s: Setup, *, seed: int = 0) -> TrainState:
    return TrainState.create(params=s.model.init(random.key(seed)), tx=s.tx, key=random.fold_in(random.key(seed), 1))


def make_step(s: Setup, backend: str) -> Any:
    return jit(train_step(lm_loss(s.model)), backend=backend, donate="state")


def batches(s: Setup) -> Any:
    return data.build_batches(s.data_cfg, tokenizer=s.tokenizer)


def run(step: Any, state: Any, it: Any, n: int) -> Tuple[Any, List[torch.Tensor]]:
    """`n` steps; the losses as 0-d tensors (cloned: metrics never alias the donated state)."""
    losses = []
    for _ in range(n):
        state, metrics = step(state, next(it))
        losses.append(metrics["loss"].detach().clone())
    return state, losses


def leaves(state: Any) -> Dict[str, torch.Tensor]:
    return {p: x.detach().clone() for p, x in tree_leaves_with_path(state) if isinstance(x, torch.Tensor)}


def _resume(args: argparse.Namespace) -> None:
    from ember.core.checkpoint import CheckpointManager

    s = setup(num_workers=args.workers)
    like = fresh_state(s, seed=123)  # a different init: every value must come from the checkpoint
    with CheckpointManager(args.ckpt_dir, read_only=True) as ckpt:
        state, data_state, meta = ckpt.restore(like=like)
    it = batches(s)
    it.set_state(data_state)
    state, losses = run(make_step(s, args.backend), state, it, args.steps - meta.step)
    it.pipeline.close()
    torch.save({"leaves": leaves(state), "losses": losses, "start": meta.step}, args.out)


if __name__ == "__main__":  # grain workers re-import this file: keep the work under the guard
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["resume"])
    p.add_argument("ckpt_dir")
    p.add_argument("steps", type=int)
    p.add_argument("out")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--backend", default="eager")
    _resume(p.parse_args())
