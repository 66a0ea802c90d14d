"""Run configs: frozen dataclasses chosen by name and overridden from the command line with tyro.

Public names: `OptimConfig`, `DataConfig`, `TrainConfig`, `register_config`, `get_config`,
`list_configs`, `parse_cli`, `to_dict`.

A run config holds the model's config (any family's config dataclass, e.g. `Llama3Config`), the
optimizer, the data, and the loop settings. Built-in configs are registered when `ember.models` is
imported; a user's package registers its own with `@register_config("name")` and is found by
`launch/train.py --import my_pkg`. A config is extended by subclassing its dataclass (decorate the
subclass with `@dataclasses.dataclass(frozen=True)`) or by `dataclasses.replace`.

Example:
    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class Tiny:
    ...     width: int = 8
    >>> _ = register_config("doc_tiny")(lambda: TrainConfig(family="mine", model=Tiny(), steps=3))
    >>> cfg = parse_cli("doc_tiny", ["--model.width", "16", "--steps", "5"])
    >>> cfg.model.width, cfg.steps
    (16, 5)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence

from .registry import Registry

__all__ = [
    "DataConfig",
    "OptimConfig",
    "TrainConfig",
    "get_config",
    "list_configs",
    "parse_cli",
    "register_config",
    "to_dict",
]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule."""

    name: Literal["adamw", "adam", "sgd", "lion", "adafactor"] = "adamw"
    """Optimizer alias in ember.optim."""
    learning_rate: float = 3e-3
    """Peak learning rate."""
    schedule: Literal["constant", "cosine", "warmup_cosine"] = "warmup_cosine"
    """Learning-rate schedule over `TrainConfig.steps`."""
    warmup_steps: int = 20
    """Linear warm-up steps (warmup_cosine only), capped at a tenth of the run."""
    end_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine schedules)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied only to matrices (ndim >= 2): no decay on norms, biases."""
    b1: float = 0.9
    """First-moment decay (adam, adamw, lion) or momentum (sgd)."""
    b2: float = 0.95
    """Second-moment decay (adam, adamw, lion)."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_norm: Optional[float] = 1.0
    """Clip gradients to this global norm; None disables clipping."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are batched."""

    source: Literal["stdlib", "text", "bin", "hf"] = "stdlib"
    """stdlib: the running Python's own standard library sources (no download); text: files or a
    glob at `path`; bin: a nanoGPT-style token .bin memmap; hf: a Hugging Face dataset saved to disk."""
    path: Optional[str] = None
    """Path for text / bin / hf sources."""
    tokenizer: Literal["bytes", "bpe"] = "bytes"
    """bytes: 256 byte values (+ EOS); bpe: a byte-level BPE trained locally on the corpus."""
    vocab_size: int = 512
    """Vocabulary size of the BPE tokenizer (ignored for bytes)."""
    max_bytes: Optional[int] = 4_000_000
    """Cap on corpus bytes read (stdlib/text), to keep start-up fast; None reads everything."""
    seq_len: int = 128
    """Tokens per training window."""
    batch_size: int = 16
    """Windows per batch (global, across data-parallel ranks)."""
    num_workers: int = 0
    """grain worker processes (0 = in the main process)."""
    collate: str = "torch"
    """Registered collator turning numpy batches into what the step takes (`@ember.data.collator`)."""
    seed: int = 0
    """Shuffle seed."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run: model, optimizer, data, loop. Every field has a default."""

    family: str = "llama3"
    """Model family in the ember.models registry."""
    model: Any = None
    """The family's config dataclass (e.g. Llama3Config); its fields are overridable as --model.X."""
    optim: OptimConfig = OptimConfig()
    """Optimizer settings."""
    data: DataConfig = DataConfig()
    """Data settings."""
    steps: int = 300
    """Training steps."""
    microbatches: int = 1
    """Gradient-accumulation microbatches inside one step."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Forward/backward dtype; master params stay float32."""
    backend: Literal["eager", "inductor", "xla"] = "inductor"
    """How the step is compiled (ember.core.jit)."""
    seed: int = 0
    """Seed of the parameter init and the step RNG key."""
    log_every: int = 10
    """Steps between metric logs (metrics stay on device in between)."""
    eval_every: int = 100
    """Steps between evaluations (and at the end)."""
    eval_batches: int = 8
    """Batches per evaluation."""
    sample_tokens: int = 200
    """Tokens generated at the end of training (0 disables)."""
    sample_prompt: str = "def "
    """Prompt of the generated sample."""
    out: Optional[str] = None
    """Run directory: metrics.jsonl, TensorBoard events, loss.png, checkpoints."""
    checkpoint_every: int = -1
    """Steps between checkpoints under out/checkpoints (and at the end); 0: only at the end; < 0: never."""
    keep: int = 3
    """How many recent checkpoints to keep (0: all)."""
    keep_best: Optional[str] = None
    """Also keep the best checkpoint by this metric: "eval_loss" (lower is better) or "name:max"."""


_CONFIGS: Registry[Callable[[], TrainConfig]] = Registry(
    "config", hint="Register one with @ember.core.config.register_config(name) in a module you --import."
)


def register_config(name: str) -> Callable[[Callable[[], TrainConfig]], Callable[[], TrainConfig]]:
    """Register a zero-argument function returning a `TrainConfig` (or subclass) under `name`."""
    return _CONFIGS.register(name)


def get_config(name: str) -> TrainConfig:
    """The registered config `name`, freshly built; unknown names list the close matches."""
    cfg = _CONFIGS.get(name)()
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"config '{name}' must return a TrainConfig (or subclass), got {type(cfg).__name__}.")
    return cfg


def list_configs() -> List[str]:
    """Names of all registered configs."""
    return _CONFIGS.names()


def _concrete_type(cfg: TrainConfig) -> type:
    """A subclass of type(cfg) whose `model` field is annotated with the model config's own type,
    so tyro offers `--model.<field>` flags for whichever family the config uses."""
    if cfg.model is None or not dataclasses.is_dataclass(cfg.model):
        return type(cfg)
    return dataclasses.make_dataclass(
        type(cfg).__name__,
        [("model", type(cfg.model), dataclasses.field(default=cfg.model))],
        bases=(type(cfg),),
        frozen=True,
    )


def parse_cli(name: str, args: Sequence[str], *, description: Optional[str] = None) -> TrainConfig:
    """Config `name` with dotted command-line overrides applied (`--model.n_layers 4 --steps 10`).

    A misspelt flag exits with tyro's message listing the closest valid flags.
    """
    import tyro  # imported here: only command lines need it

    base = get_config(name)
    concrete = _concrete_type(base)
    default = concrete(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    return tyro.cli(concrete, default=default, args=list(args), description=description)


def to_dict(cfg: Any) -> Dict[str, Any]:
    """A JSON-serialisable dict of a (nested) config, with each dataclass's type name recorded."""

    def conv(x: Any) -> Any:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            d = {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
            return {"__type__": type(x).__name__, **d}
        if isinstance(x, (list, tuple)):
            return [conv(v) for v in x]
        if isinstance(x, dict):
            return {str(k): conv(v) for k, v in x.items()}
        if isinstance(x, (str, int, float, bool)) or x is None:
            return x
        return repr(x)

    out = conv(cfg)
    json.dumps(out)  # fail here, not when a checkpoint is written
    return out
