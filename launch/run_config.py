"""Run configs: frozen dataclasses chosen by name and overridden from the command line with tyro.

Public names: `TrainConfig`, `register_config`, `get_config`, `list_configs`, `parse_cli`,
`to_dict`.

A run config holds the model's config (any family's config dataclass, e.g. `Llama3Config`), the
optimizer (`ember.optim.OptimConfig`), the data (`ember.data.DataConfig`) and the loop settings.
The built-in configs live in `ember.launch.presets`; a user's package registers its own with
`@register_config("name")` and is found by `launch/train.py --import my_pkg`. A config is extended
by subclassing its dataclass (decorate the subclass with `@dataclasses.dataclass(frozen=True)`) or
by `dataclasses.replace`.

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
import importlib
from typing import Any, Callable, List, Literal, Optional, Sequence

from ember.core.config_checks import check_fields, non_negative_int, positive_int
from ember.core.dataclass_json import to_dict
from ember.core.registry import Registry
from ember.data.config import DataConfig
from ember.optim.config import OptimConfig

__all__ = [
    "TrainConfig",
    "get_config",
    "list_configs",
    "parse_cli",
    "register_config",
    "to_dict",
]


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

    def __post_init__(self) -> None:
        check_fields(self, steps=positive_int, microbatches=positive_int, seed=non_negative_int,
                     log_every=positive_int, eval_every=non_negative_int, eval_batches=positive_int,
                     sample_tokens=non_negative_int, keep=non_negative_int)


_CONFIGS: Registry[Callable[[], TrainConfig]] = Registry(
    "config", hint="Register one with @ember.launch.register_config(name) in a module you --import."
)


def register_config(name: str) -> Callable[[Callable[[], TrainConfig]], Callable[[], TrainConfig]]:
    """Register a zero-argument function returning a `TrainConfig` (or subclass) under `name`."""
    return _CONFIGS.register(name)


def _register_presets() -> None:
    importlib.import_module("ember.launch.presets")  # the built-in configs register on import


def get_config(name: str) -> TrainConfig:
    """The registered config `name`, freshly built; unknown names list the close matches."""
    _register_presets()
    cfg = _CONFIGS.get(name)()
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"config '{name}' must return a TrainConfig (or subclass), got {type(cfg).__name__}.")
    return cfg


def list_configs() -> List[str]:
    """Names of all registered configs."""
    _register_presets()
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
