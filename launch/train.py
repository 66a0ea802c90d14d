"""Train a model with ember's pure step: the default run, any registered config, or your own.

    python launch/train.py                                    # llama3_tiny on the stdlib corpus (make train)
    python launch/train.py --config gpt2_tiny --steps 50 --out runs/gpt2
    python launch/train.py --model.n_layers 2 --optim.learning_rate 1e-3 --backend eager
    python launch/train.py --import my_pkg --config my_config  # a family / config from your package
    python launch/train.py --dry-run                          # parameters, axes, memory; no step
    python launch/train.py --out runs/a --checkpoint_every 100 --resume   # continue from the latest checkpoint
    torchrun --nproc-per-node 4 launch/train.py --mesh fsdp=2,tp=2   # DTensor: see launch/_sharded.py

Every config field is a flag (`--help` lists them). The pieces are importable for your own script:
`ember.models.build_model`, `ember.optim.from_config`, `ember.data.build_batches`,
`ember.core.step_fns.train_step` / `train_loop` / `evaluate`.
"""

import argparse
import importlib
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling helpers, also when imported


def parse_launcher_args(argv):
    """Split off the launcher's own flags; the rest are config overrides for tyro."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", default="llama3_tiny")
    p.add_argument("--import", dest="imports", action="append", default=[])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--mesh", default=None)  # under torchrun: e.g. dp=2,tp=2 (default dp=-1)
    p.add_argument("--resume", action="store_true")  # continue from the latest checkpoint in --out
    return p.parse_known_args(argv)


def main(argv=None):
    args, overrides = parse_launcher_args(sys.argv[1:] if argv is None else argv)
    import torch

    import ember.models as models
    from ember import data
    from ember.core import TrainState, random
    from ember.core.config import parse_cli, to_dict
    from ember.core.device import device_for, to_device
    from ember.core.host_memory import retain_freed_host_memory
    from ember.core.jit import jit
    from ember.optim.config import from_config as optim_from_config
    from ember.core.metrics_log import MetricsWriter, plot_losses, read_metrics
    from ember.core.step_fns import eval_step, evaluate, generate, train_loop, train_step

    import _checkpointing
    import _sharded

    retain_freed_host_memory()  # a step frees and re-allocates the same buffers: keep their pages
    for name in args.imports:
        importlib.import_module(name)  # registers the user's families, archs, configs, collators
    cfg = parse_cli(args.config, overrides, description=__doc__)
    model = models.build_model(cfg.family, cfg.model)
    models.check_lm_data(model, seq_len=cfg.data.seq_len)
    if args.dry_run:
        print(models.describe(model))
        return None
    sharding = _sharded.setup(args.mesh)  # None unless under torchrun or --mesh; before any device tensor
    main_rank = _sharded.is_main()  # only rank 0 writes files and prints
    tokenizer = data.build_tokenizer(cfg.data)
    models.check_lm_data(model, seq_len=cfg.data.seq_len, vocab_size=tokenizer.vocab_size)
    device = device_for(cfg.backend)
    params = to_device(model.init(random.key(cfg.seed)), device)
    tx = optim_from_config(cfg.optim, total_steps=cfg.steps)
    state = TrainState.create(params=params, tx=tx, key=random.fold_in(random.key(cfg.seed, device=device), 1))
    state = _sharded.shard_state(state, sharding, model)
    loss_fn = models.lm_loss(model)
    compute_dtype = None if cfg.compute_dtype == "float32" else getattr(torch, cfg.compute_dtype)
    step = _sharded.sharded(jit(train_step(loss_fn, microbatches=cfg.microbatches, compute_dtype=compute_dtype),
                                backend=cfg.backend, donate="state"), sharding, returns_state=True)
    ckpt = _checkpointing.build_manager(cfg)  # OUT/checkpoints (None without --out)
    info = _checkpointing.model_info_for(cfg, arch=args.config)
    batches = data.build_batches(cfg.data, tokenizer=tokenizer, device=device)
    start = int(state.step)
    state = _checkpointing.maybe_resume(ckpt, state, batches, cfg=cfg, resume=args.resume, model_info=info,
                                        sharding=sharding, axes=model.axes, log=print if main_rank else (lambda _: None))
    resumed = int(state.step) != start
    eval_one = _sharded.sharded(jit(eval_step(loss_fn, compute_dtype=compute_dtype), backend=cfg.backend),
                                sharding, returns_state=False)

    def eval_fn(state):
        batches = data.build_batches(cfg.data, tokenizer=tokenizer, split="eval", device=device)
        return evaluate(eval_one, state.params, itertools.islice(batches, cfg.eval_batches))

    writer = MetricsWriter(cfg.out if main_rank else None, append=resumed)
    hooks = dict(cfg=cfg, writer=writer, model_info=info, sharding=sharding)
    try:
        if cfg.out and main_rank:
            with open(os.path.join(cfg.out, "config.json"), "w") as f:
                json.dump(to_dict(cfg), f, indent=2)
        if not resumed:
            writer.write(0, eval_fn(state), prefix="eval_")  # the loss before any step, for reference
        state = train_loop(step, state, batches, steps=cfg.steps, writer=writer, log_every=cfg.log_every,
                           eval_every=cfg.eval_every, eval_fn=eval_fn, progress=main_rank,
                           tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
                           on_step_end=_checkpointing.checkpoint_hook(ckpt, batches, **hooks))
        _checkpointing.finish(ckpt, state, batches, **hooks)
        params = _sharded.gathered(state.params, sharding)  # whole tensors on every rank, for sampling
    finally:
        writer.close()
        if ckpt is not None:
            ckpt.close()
        _sharded.teardown()
    if not main_rank:
        return writer.history
    history = read_metrics(cfg.out) if resumed else writer.history  # a resumed run: the whole run's log
    if cfg.out:
        plot_losses(history, os.path.join(cfg.out, "loss.png"))
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    (s0, e0), (_, e1) = evals[0], evals[-1]
    print(f"eval loss: {e0:.4f} at step {s0} -> {e1:.4f} at step {cfg.steps} ({100 * (1 - e1 / e0):.1f}% lower)")
    if cfg.sample_tokens:
        prompt = torch.tensor([tokenizer.encode(cfg.sample_prompt).tolist()], device=device)
        out = generate(model.apply, params, prompt, max_new_tokens=cfg.sample_tokens, key=random.key(cfg.seed),
                       temperature=0.8, top_k=40, max_seq_len=cfg.data.seq_len)
        print("--- sample ---\n" + tokenizer.decode(out[0].cpu().tolist()) + "\n--------------")
    return writer.history


if __name__ == "__main__":
    main()
