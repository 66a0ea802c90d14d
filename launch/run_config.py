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

import contextlib
import dataclasses
import difflib
import importlib
import io
import sys
import typing
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Set, Tuple

from ember.core.config_checks import check_fields, non_negative_int, positive_int
from ember.core.dataclass_json import to_dict
from ember.core.registry import Registry
from ember.data.config import DataConfig
from ember.launch.flag_spelling import bool_words, one_line
from ember.launch.lm_eval_tasks import EvalConfig
from ember.launch.profiling import ProfileConfig
from ember.launch.trackers import LogConfig
from ember.models.lora import LoRAConfig
from ember.models.preference import DPOConfig
from ember.optim.config import OptimConfig

__all__ = [
    "TrainConfig",
    "describe_configs",
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
    """Model family in the ember.models registry; "": the family and model of the --init_from weights (as --config sft)."""
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
    pipeline_microbatches: Optional[int] = None
    """Under a mesh with pp: the pipeline cuts each (gradient-accumulation) batch into this many, >= the
    stages (None: one per stage; more shrink the bubble, (pp - 1) / (repeats * this + pp - 1))."""
    pipeline_repeats: int = 1
    """Under a mesh with pp: circular passes through the stages (each holds every repeat's layers)."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Forward/backward dtype; master params, gradients, optimizer and loss stay float32. auto: bfloat16 on a
    CUDA GPU that supports it, else float32 (ember.launch.precision)."""
    tf32: bool = True
    """On CUDA, float32 matmuls use TF32 tensor cores (torch.set_float32_matmul_precision("high")); False: full float32."""
    cuda_graph: bool = False
    """Replay the donated compiled step as one CUDA graph (inductor, one CUDA GPU; opt-in, see ember.core.jit)."""
    deterministic: bool = True
    """Compiled steps repeat bit for bit (inductor: deterministic kernels, see ember.core.jit); False: the fastest kernels."""
    backend: Literal["eager", "inductor", "xla"] = "inductor"
    """How the step is compiled (ember.core.jit)."""
    seed: int = 0
    """Seed of the parameter init and the step RNG key."""
    init_from: Optional[str] = None
    """Start from these weights instead of a random init: a Hugging Face model folder or an ember run /
    checkpoint directory (its latest params; the run starts at step 0). Checked against the model config."""
    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters (--lora.rank R > 0): only they train, and `launch/ckpt.py export --hf` merges them in."""
    dpo: DPOConfig = DPOConfig()
    """The preference objective of a run on pairs (data.source=preference, `--config dpo`)."""
    log_every: int = 10
    """Steps between metric logs (metrics stay on device in between)."""
    eval_every: int = 100
    """Steps between evaluations (and at the end); 0: no evaluation (the eval split is not even built)."""
    eval_batches: int = 8
    """Batches per evaluation."""
    eval: EvalConfig = EvalConfig()
    """lm-eval tasks scored at every evaluation (`--eval.lm_eval_tasks`)."""
    log: LogConfig = LogConfig()
    """Experiment trackers beside metrics.jsonl and TensorBoard (`--log.wandb`, `--log.mlflow`)."""
    profile: ProfileConfig = ProfileConfig()
    """A profiler trace of chosen steps (`--profile.steps A:B`) and a memory snapshot (`--profile.memory`)."""
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
        check_fields(self, steps=positive_int, microbatches=positive_int, pipeline_repeats=positive_int,
                     seed=non_negative_int,
                     log_every=positive_int, eval_every=non_negative_int, eval_batches=positive_int,
                     sample_tokens=non_negative_int, keep=non_negative_int)
        if self.pipeline_microbatches is not None:
            check_fields(self, pipeline_microbatches=positive_int)
        if self.keep_best:
            self._check_keep_best()
        self.profile.check(steps=self.steps)  # --profile.steps within the run's steps

    def _check_keep_best(self) -> None:
        name, _, mode = self.keep_best.partition(":")
        if mode not in ("", "min", "max"):
            raise ValueError(f"keep_best={self.keep_best!r}: the mode after ':' must be min or max; e.g. "
                             f"--keep_best {name} (lower is better) or --keep_best {name}:max.")
        if self.eval_every == 0:
            raise ValueError(f"keep_best={self.keep_best!r} ranks checkpoints by an evaluation, but eval_every=0 runs "
                             f"none; pass --eval_every N (e.g. --eval_every {max(self.checkpoint_every, 100)}), or drop "
                             f"--keep_best.")
        if self.out is None or self.checkpoint_every < 0:
            raise ValueError(f"keep_best={self.keep_best!r} keeps a checkpoint, but checkpoints are off (out="
                             f"{self.out!r}, checkpoint_every={self.checkpoint_every}); pass --out DIR --checkpoint_every N.")
        if self.checkpoint_every > 0 and (self.eval_every == 0 or self.checkpoint_every % self.eval_every):
            every = self.eval_every or self.checkpoint_every
            raise ValueError(f"keep_best={self.keep_best!r} ranks checkpoints by an evaluation, but checkpoint_every="
                             f"{self.checkpoint_every} saves steps that eval_every={self.eval_every} does not evaluate; "
                             f"pass --checkpoint_every {every * max(1, self.checkpoint_every // every)} (a multiple of "
                             f"eval_every) or --eval_every {self.checkpoint_every}.")


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


def describe_configs() -> Dict[str, str]:
    """`{name: the first line of its function's docstring}` for every registered config."""
    return {name: ((_CONFIGS.get(name).__doc__ or "").strip().splitlines() or [""])[0] for name in list_configs()}


def _config_classes(cls: type) -> Set[type]:
    """`cls` and every dataclass type its fields hold (nested, also inside Optional)."""
    found = {cls}
    for hint in typing.get_type_hints(cls).values():
        for t in (hint, *typing.get_args(hint)):
            if isinstance(t, type) and dataclasses.is_dataclass(t) and t not in found:
                found |= _config_classes(t)
    return found


def _field_hints(cls: type, prefix: str = "") -> Dict[str, Any]:
    """Dotted name -> type hint of each field of dataclass `cls`, nested dataclasses (also in Optional) included."""
    hints = typing.get_type_hints(cls)
    found: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        found[prefix + f.name] = hint
        for t in (hint, *typing.get_args(hint)):
            if isinstance(t, type) and dataclasses.is_dataclass(t):
                found.update(_field_hints(t, f"{prefix}{f.name}."))
    return found


def _field_paths(cls: type) -> Set[str]:
    """Dotted names of every field of dataclass `cls`, nested dataclasses (also inside Optional) included."""
    return set(_field_hints(cls))


def _is_subsequence(short: str, long: str) -> bool:
    chars = iter(long)
    return all(c in chars for c in short)


def _closest_flags(name: str, paths: Set[str]) -> List[str]:
    """Fields near `name`: a close spelling, or an abbreviation (`lrr` of `learning_rate`) in the same group."""
    head, _, last = name.rpartition(".")
    leaves = sorted(p for p in paths if not any(q.startswith(p + ".") for q in paths))
    siblings = {p.rpartition(".")[2]: p for p in leaves if p.rpartition(".")[0] == head}
    close = difflib.get_close_matches(last, list(siblings), n=3, cutoff=0.6)
    close += [n for n in siblings if n not in close and _is_subsequence(last, n)][: 3 - len(close)]
    return [siblings[n] for n in close] or difflib.get_close_matches(name, leaves, n=3, cutoff=0.6)


def check_flags(cls: type, args: Sequence[str]) -> None:
    """Raise ValueError naming the closest valid flags for each `--flag` in `args` that `cls` lacks."""
    paths = _field_paths(cls)
    for arg in args:
        if not arg.startswith("--") or arg == "--help":
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        head, _, last = name.rpartition(".")
        negated = f"{head}.{last[3:]}" if head else last[3:]  # tyro's --no-<bool>
        if name in paths or (last.startswith("no_") and negated in paths):
            continue
        close = _closest_flags(name, paths)
        hint = f"did you mean {' or '.join('--' + c for c in close)}? " if close else ""
        raise ValueError(f"unknown flag {arg.split('=', 1)[0]}; {hint}`--help` lists every flag "
                         f"(`--list-configs` the run configs).")


class _Rejected(Exception):
    """A config's own check failed while tyro parsed: carried past tyro (which boxes ValueErrors)."""


@contextlib.contextmanager
def _checks_raise_past_tyro(classes: Set[type]) -> Iterator[None]:
    """While tyro builds the configs, their `__post_init__` ValueErrors reach the caller as they are, so
    the launcher prints ember's message as one `error:` line (tyro would box it). Restored after."""
    saved = {cls: cls.__dict__.get("__post_init__") for cls in classes if hasattr(cls, "__post_init__")}

    def escaping(check: Callable) -> Callable:
        def __post_init__(self: Any) -> None:
            try:
                check(self)
            except ValueError as error:
                raise _Rejected(error) from None
        return __post_init__

    for cls in saved:
        cls.__post_init__ = escaping(cls.__post_init__)
    try:
        yield
    finally:
        for cls, own in saved.items():
            if own is None:
                del cls.__post_init__
            else:
                cls.__post_init__ = own


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

    A bool field also takes a value (`--model.tie_embeddings False`, `true`, `0`, `1`); tyro's parse
    errors come back as a one-line ValueError naming the flag and an example value.

    Raises:
        ValueError: a flag that is no field (names the closest ones); a value out of range or of the
            wrong type.
    """
    import tyro  # imported here: only command lines need it

    base, args = _model_of_init_from(get_config(name), args)
    concrete = _concrete_type(base)
    args = bool_words(args, _field_hints(concrete))  # `--flag False` as well as `--flag` / `--no-flag`
    check_flags(concrete, args)
    default = concrete(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    printed = io.StringIO()  # tyro's boxed errors, turned into one line below
    try:
        with _checks_raise_past_tyro(_config_classes(concrete)), contextlib.redirect_stderr(printed):
            cfg = tyro.cli(concrete, default=default, args=list(args), description=description)
        return _tokenizer_of_init_from(cfg, args)
    except _Rejected as rejected:
        raise rejected.args[0] from None
    except SystemExit as exit_:
        if exit_.code in (0, None):
            raise
        text, printed = printed.getvalue(), io.StringIO()  # the box is not printed: it becomes one line
        raise ValueError(one_line(text, args, lambda path: _value_at(default, path))) from None
    finally:
        sys.stderr.write(printed.getvalue())  # tyro's warnings, if any


def _saved_family_asked(args: Sequence[str]) -> Tuple[bool, List[str]]:
    """(whether the last `--family` of `args` is "", `args` without that flag and its value)."""
    asked, kept, i = False, [], 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag == "--family":
            value = value if eq else (args[i + 1] if i + 1 < len(args) else None)
            asked = value == ""
            if asked:
                i += 1 if eq else 2
                continue
        kept.append(args[i])
        i += 1
    return asked, kept


def _model_of_init_from(base: TrainConfig, args: Sequence[str]) -> Tuple[TrainConfig, Sequence[str]]:
    """A config with neither family nor model (`--config sft`), or `--family ""`, takes both from its
    `--init_from` weights; returns it and the flags left for tyro."""
    asked, rest = _saved_family_asked(args)
    if {"-h", "--help"} & set(args) or not (asked or (not base.family and base.model is None)):
        return base, args
    args = rest
    path = base.init_from
    for i, arg in enumerate(args):  # the last one wins, as in tyro
        flag, eq, value = arg.partition("=")
        if flag.startswith("--") and flag[2:].replace("-", "_") == "init_from":
            path = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    if not path:
        what = '--family "" takes the family and model' if asked else "this run config takes its model"
        raise ValueError(f"{what} from the weights it starts from: pass --init_from FOLDER (a Hugging Face model "
                         f"folder, or an ember run directory).")
    from ember.launch.init_from import with_saved_model  # here: init_from reads the registered configs

    return with_saved_model(base, path), args


def _named(args: Sequence[str], *fields: str) -> bool:
    """True if `args` set one of the dotted `fields` (any spelling: `--data.tokenizer-path=x`)."""
    return any(a.startswith("--") and a[2:].split("=", 1)[0].replace("-", "_") in fields for a in args)


def _tokenizer_of_init_from(cfg: TrainConfig, args: Sequence[str]) -> TrainConfig:
    """`--init_from` weights come with the tokenizer they were trained with, unless `--data.tokenizer` is given."""
    if not cfg.init_from:
        return cfg
    from ember.launch.init_from import with_saved_tokenizer  # here: init_from reads the registered configs

    return with_saved_tokenizer(cfg, chosen=_named(args, "data.tokenizer", "data.tokenizer_path"))


def _value_at(cfg: Any, path: str) -> Any:
    """The value of dotted field `path` in `cfg`, or None."""
    for name in path.split("."):
        cfg = getattr(cfg, name, None)
    return cfg
