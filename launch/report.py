"""The run directory's own files and the end-of-run report: config.json, the loss plot, a sample."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List

import torch

from ember.core import random
from ember.core.dataclass_json import to_dict
from ember.core.step_fns import generate
from ember.core.tree_math import tree_all_finite
from ember.launch.metrics_log import plot_losses
from ember.launch.run_config import TrainConfig

__all__ = ["CONFIG_FILE", "PLOT_FILE", "eval_summary", "report_run", "save_config"]

CONFIG_FILE = "config.json"
PLOT_FILE = "loss.png"


def save_config(cfg: TrainConfig) -> None:
    """Write the run config to `OUT/config.json` (nothing without `cfg.out`)."""
    if cfg.out:
        with open(os.path.join(cfg.out, CONFIG_FILE), "w") as f:
            json.dump(to_dict(cfg), f, indent=2)


def plot_title(cfg: TrainConfig) -> str:
    """`"runs/default: llama3 (4 layers, d_model 192), 300 steps"`: which run a loss plot shows."""
    shape = ", ".join(f"{k} {getattr(cfg.model, k)}" for k in ("n_layers", "d_model") if hasattr(cfg.model, k))
    return f"{cfg.out or 'run'}: {cfg.family}{f' ({shape})' if shape else ''}, {cfg.steps} steps"


def eval_summary(history: List[Dict[str, float]]) -> str:
    """The first and last eval loss of `history` as one line (one eval point: it and the last train loss)."""
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    if not evals:
        return "eval loss: none logged"
    (s0, e0), (s1, e1) = evals[0], evals[-1]
    if s1 == s0:
        trained = [(r["step"], r["loss"]) for r in history if "loss" in r]
        later = f"; last train loss {trained[-1][1]:.4f} at step {trained[-1][0]}" if trained else ""
        return f"eval loss: {e0:.4f} at step {s0} (the only evaluation{later})"
    line = f"eval loss: {e0:.4f} at step {s0} -> {e1:.4f} at step {s1}"
    if not (math.isfinite(e0) and math.isfinite(e1) and e0 > 0):
        return line
    change = 100 * (1 - e1 / e0)
    return f"{line} ({change:.1f}% lower)" if change >= 0 else f"{line} ({-change:.1f}% higher)"


def report_run(cfg: TrainConfig, history: List[Dict[str, float]], *, model: Any, params: Any, tokenizer: Any,
               device: Any, sample: bool = True) -> None:
    """Plot `history` to `OUT/loss.png`, print the first and last eval loss, then (if `sample`) a sample."""
    if cfg.out:
        plot_losses(history, os.path.join(cfg.out, PLOT_FILE), title=plot_title(cfg))
    summary = eval_summary(history)
    print(summary if cfg.eval_every or "none" not in summary else "eval loss: none (--eval_every 0 evaluates nothing)")
    if sample and cfg.sample_tokens and not bool(tree_all_finite(params)):  # one host sync
        print("no sample: the parameters hold NaN or infinite values (the run diverged); lower --optim.learning_rate")
    elif sample and cfg.sample_tokens:
        chat = getattr(tokenizer, "chat_template", None) is not None and cfg.data.source in ("sft", "preference")
        if chat:  # the prompt as a user turn, rendered with the model's template, up to the assistant's cue
            ids = tokenizer.apply_chat_template([{"role": "user", "content": cfg.sample_prompt}], add_generation_prompt=True)
        else:
            ids = tokenizer.encode(cfg.sample_prompt)
        prompt = torch.tensor([ids.tolist()], device=device)
        out = generate(model.apply, params, prompt, max_new_tokens=cfg.sample_tokens, key=random.key(cfg.seed, device=device),
                       temperature=0.8, top_k=40, max_seq_len=cfg.data.seq_len,
                       vocab_size=tokenizer.vocab_size)[0].cpu().tolist()  # never the padded embedding rows
        if chat and tokenizer.eos_id in out[len(ids):]:  # the reply ends at the end of its turn
            out = out[:len(ids) + out[len(ids):].index(tokenizer.eos_id) + 1]
        print("--- sample ---\n" + tokenizer.decode(out) + "\n--------------")
