"""What a run is made of, built from its `TrainConfig`: model, tokenizer, initial state, step functions.

`launch/train.py` (Inductor / eager, DTensor under torchrun) and `launch/tpu_pod.py` (torch_xla
SPMD) build the same pieces here, so a run config means the same model, data and optimizer on
every launcher and the checkpoints of one resume on the other.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Optional

import torch

from ember import data, models, optim
from ember.core import TrainState, TrainStateWithFrozen, device_for, pytree, random, to_device
from ember.core.step_fns import eval_step, train_step
from ember.core.step_fns.preference_losses import REFERENCE_FREE
from ember.launch.checkpointing import already_finished, check_resume_model
from ember.launch.init_from import check_init_from, load_initial_params
from ember.launch.loop import evaluate
from ember.launch.precision import resolve_compute_dtype
from ember.launch.run_config import TrainConfig
from ember.models.lora import lora_mask
from ember.optim.config import from_config

__all__ = ["build_model", "build_tokenizer", "check_backend", "compute_dtype", "eval_fn", "evaluator", "initial_state",
           "objective", "precomputed_reference", "preference_run", "preflight", "step_fn"]


def check_backend(cfg: TrainConfig) -> None:
    """Refuse `--backend xla` where torch_xla cannot be imported (a ValueError naming the fix)."""
    if cfg.backend != "xla":
        return
    from ember.core.xla import require_torch_xla

    try:
        require_torch_xla("--backend xla")
    except ImportError as error:
        cause = error.__cause__ or error
        raise ValueError(f"--backend xla needs torch_xla, which is not importable here ({cause}); run under the "
                         f"XLA environment (`make install-xla`, then .venv-xla/bin/python launch/train.py ..., or "
                         f"pip install \"ember[xla]\" in its own environment), or pass --backend inductor.") from None


def preflight(cfg: TrainConfig, args: Any, *, main: bool) -> bool:
    """Whether to train, after the checks that read saved runs: made once the process group is up
    (orbax then starts jax as one of the ranks) and before the run directory is touched. An
    `--init_from` or a `--resume` of another model raises; a `--resume` of a run that already reached `--steps` is
    no mistake: its notice is printed (on the `main` rank) and nothing changes."""
    if cfg.init_from:
        check_init_from(cfg.init_from, cfg.family, cfg.model, config_name=args.config)
    check_resume_model(cfg, resume=args.resume, step=args.resume_step, config_name=args.config)
    notice = already_finished(cfg, resume=args.resume, step=args.resume_step)
    if notice and main:
        print(notice)
    return notice is None


def build_model(cfg: TrainConfig) -> Any:
    """The model of `cfg.family` with `cfg.model`, checked against the data's sequence length; with
    `--lora.rank R` it carries LoRA adapters (`ember.models.lora.LoRAModel`, the base frozen)."""
    preference_run(cfg)  # --dpo flags on other data: refused before anything is built
    model = models.build_model(cfg.family, cfg.model)
    models.check_lm_data(model, seq_len=cfg.data.seq_len)
    if cfg.lora.rank:
        model = models.to_lora(model, rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=cfg.lora.pattern())
    return model


def build_tokenizer(cfg: TrainConfig, model: Any) -> data.Tokenizer:
    """The run's tokenizer, checked against the model's vocabulary."""
    tokenizer = data.build_tokenizer(cfg.data)
    models.check_lm_data(model, seq_len=cfg.data.seq_len, vocab_size=tokenizer.vocab_size)
    return tokenizer


def initial_state(cfg: TrainConfig, model: Any, device: Any = "cpu") -> TrainState:
    """Parameters from `key(cfg.seed)` (or `cfg.init_from`), the optimizer of `cfg.optim`, the step key
    `fold_in(key(seed), 1)`. A LoRA model's base params come the same way, its adapters from
    `fold_in(key(seed), 2)`, and the optimizer updates the adapters only."""
    lora = isinstance(model, models.LoRAModel)
    base = model.base if lora else model
    if cfg.init_from:
        from ember.core.checkpoint import model_info

        params = load_initial_params(cfg.init_from, base, model_info=model_info(cfg.family, cfg.model), device=device)
    else:
        params = to_device(base.init(random.key(cfg.seed)), device)
    if lora and cfg.optim.name == "muon":
        raise ValueError("--optim.name muon orthogonalises a model's full matrices, but --lora.rank trains low-rank "
                         "adapters; train LoRA with --optim.name adamw.")
    tx = from_config(cfg.optim, total_steps=cfg.steps, axes=base.axes)
    if lora:
        params = model.init_from(params, key=random.fold_in(random.key(cfg.seed, device=device), 2))
        tx = optim.masked(tx, lora_mask(params))  # the base is frozen: its updates pass through as zeros
    key = random.fold_in(random.key(cfg.seed, device=device), 1)
    if preference_run(cfg) and cfg.dpo.needs_reference(model):  # the reference: a frozen copy of the start
        return TrainStateWithFrozen.create(params=params, tx=tx, key=key, frozen=_copy(params))
    return TrainState.create(params=params, tx=tx, key=key)


def _copy(tree: Any) -> Any:
    """A copy of `tree` whose tied leaves (one tensor twice) stay one tensor."""
    copies: dict = {}
    return pytree.tree_map(lambda t: copies.setdefault(id(t), t.clone()) if isinstance(t, torch.Tensor) else t, tree)


def preference_run(cfg: TrainConfig) -> bool:
    """Whether `cfg` trains on preference pairs (its objective `cfg.dpo`), refusing `--dpo.*` flags on other data."""
    if cfg.data.source == "preference":
        return True
    if cfg.dpo != type(cfg.dpo)():
        raise ValueError(f"--dpo.* flags set the objective of a run on preference pairs, but data.source="
                         f"{cfg.data.source}; pass --config dpo (or --data.source preference --data.path PAIRS.jsonl), "
                         f"or drop the --dpo flags.")
    return False


def precomputed_reference(cfg: TrainConfig, model: Any, params: Any, tokenizer: Any,
                          device: Any = None) -> Optional[Dict[str, Any]]:
    """`--dpo.precompute_reference`: the starting weights' log-probabilities of every pair, `{split: (chosen,
    rejected)}`, scored once before the state is sharded (and donated); None when the run does not ask for them.
    A LoRA policy is scored by its base (its reference)."""
    if not (preference_run(cfg) and cfg.dpo.precompute_reference and cfg.dpo.loss not in REFERENCE_FREE):
        return None
    lora = isinstance(model, models.LoRAModel)
    ref_model, ref_params = (model.base, params["base"]) if lora else (model, params)
    scores = {}
    for split in ("train", "eval") if cfg.eval_every else ("train",):
        pairs = data.read_preference_pairs(cfg.data.path, tokenizer=tokenizer, seq_len=cfg.data.seq_len,
                                           overflow=cfg.data.overflow, split=split)
        scores[split] = models.reference_logps(ref_model, ref_params, pairs.rows, batch_size=cfg.data.batch_size,
                                               device=device)
    return scores


def objective(cfg: TrainConfig, model: Any) -> Callable:
    """The run's loss function: `cfg.dpo`'s preference loss on pairs, else the language-model loss."""
    return cfg.dpo.loss_fn(model) if preference_run(cfg) else models.lm_loss(model)


def compute_dtype(cfg: TrainConfig) -> Optional[torch.dtype]:
    """None for float32 (no casting), else the torch dtype `cfg.compute_dtype` means on the run's device
    ("auto": bfloat16 on a CUDA GPU that supports it; float32 on the CPU and torch_xla)."""
    device = torch.device("xla") if cfg.backend == "xla" else device_for(cfg.backend)
    return resolve_compute_dtype(cfg.compute_dtype, device)


def step_fn(cfg: TrainConfig, model: Any) -> Callable:
    """The pure training step `(state, batch) -> (state, metrics)` of the run's objective."""
    return train_step(objective(cfg, model), microbatches=cfg.microbatches, compute_dtype=compute_dtype(cfg))


def eval_fn(cfg: TrainConfig, model: Any) -> Callable:
    """The pure evaluation `(params or state, batch) -> metrics` of the run's objective."""
    return eval_step(objective(cfg, model), compute_dtype=compute_dtype(cfg))


def evaluator(cfg: TrainConfig, eval_one: Callable, *, tokenizer: Any, device: Any,
              context_parallel: int = 1, reference_logps: Optional[Dict[str, Any]] = None,
              model: Any = None, sharding: Any = None) -> Callable:
    """`eval_fn(state) -> metrics`: `eval_one` averaged over `cfg.eval_batches` batches of the eval split
    (in `cp`'s sequence order when `context_parallel` > 1; pairs with `reference_logps`, when precomputed);
    with `--eval.lm_eval_tasks`, also those tasks' scores on the live params of `model` (`lm_eval/<task>/<metric>`)."""
    lm_eval_scores = None
    if cfg.eval.lm_eval_tasks:  # task names checked now, before any step
        if model is None:
            raise ValueError("--eval.lm_eval_tasks scores the live model, but this launcher does not pass it to the "
                             "evaluator; run launch/eval.py on the run's checkpoints instead.")
        from ember.launch.lm_eval_tasks import training_scorer

        lm_eval_scores = training_scorer(cfg.eval, model, tokenizer, backend=cfg.backend,
                                         batch_size=cfg.data.batch_size, sharding=sharding)

    def eval_fn(state: TrainState) -> Any:
        batches = data.build_batches(cfg.data, tokenizer=tokenizer, split="eval", device=device,
                                     context_parallel=context_parallel, reference_logps=reference_logps)
        target = state if getattr(state, "frozen", None) is not None else state.params  # a reference reads frozen
        metrics = evaluate(eval_one, target, itertools.islice(batches, cfg.eval_batches))
        return metrics if lm_eval_scores is None else {**metrics, **lm_eval_scores(state.params)}

    return eval_fn
