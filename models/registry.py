"""Model families and named architectures (fairseq2-style), with loud errors.

Public names: `ModelRegistry`, `Family`, `register_family`, `family`, `arch`, `get_config`,
`build_model`, `list_archs`, `list_families`, `replace_config`.

A *family* is a config dataclass plus a function building a model from it (`"gpt2"`,
`"llama3"`). An *architecture* is a named preset of a family: a zero-argument function returning
a config, registered with `@arch(family, name)`. Presets may derive from one another by calling
`get_config` and `.replace(...)`:

    @arch("llama3", "3.1-8b")
    def _llama31_8b():
        return get_config("llama3", "8b").replace(rope_scaling=RopeScaling(), max_seq_len=131072)

Registering a name twice raises `ValueError`; an unknown family, architecture or config field
raises (`KeyError` / `ValueError`) listing the known names and the closest match. The built-in
families register themselves when `ember.models` is imported.

Example:
    >>> from ember.models import build_model, get_config, list_archs
    >>> "tiny" in list_archs("llama3")
    True
    >>> get_config("llama3", "tiny", n_layers=3).n_layers
    3
    >>> get_config("llama3/8b").d_model
    4096
    >>> build_model("gpt2", "tiny").config.n_layers
    4
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Dict, List, Optional, TypeVar, Union

from ..core.registry import Registry

__all__ = [
    "Family",
    "ModelRegistry",
    "arch",
    "build_model",
    "family",
    "get_config",
    "list_archs",
    "list_families",
    "register_family",
    "replace_config",
]

C = TypeVar("C")


def replace_config(config: C, **changes: Any) -> C:
    """`dataclasses.replace` that names the closest field when a key is misspelt.

    Raises:
        TypeError: `config` is not a dataclass instance.
        ValueError: a key in `changes` is not a field of the config (lists the fields).
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"replace_config needs a dataclass instance, got {type(config).__name__}.")
    names = [f.name for f in dataclasses.fields(config)]
    for k in changes:
        if k not in names:
            close = difflib.get_close_matches(k, names, n=1, cutoff=0.5)
            guess = f"; did you mean {close[0]!r}?" if close else "."
            raise ValueError(f"{type(config).__name__} has no field {k!r}{guess} Fields: {names}.")
    return dataclasses.replace(config, **changes)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: its config class and the function that builds a model from a config."""

    name: str
    config_cls: type
    build_fn: Callable[[Any], Any]


class ModelRegistry:
    """Families and their architectures. `ember.models` uses one default instance.

    Example:
        >>> import dataclasses
        >>> reg = ModelRegistry()
        >>> @dataclasses.dataclass(frozen=True)
        ... class Cfg:
        ...     width: int = 8
        >>> _ = reg.register_family("toy", Cfg, lambda cfg: cfg.width)
        >>> _ = reg.arch("toy", "wide")(lambda: Cfg(width=64))
        >>> reg.build_model("toy", "wide")
        64
    """

    def __init__(self) -> None:
        self._families: Registry[Family] = Registry(
            "model family",
            hint="Register one with ember.models.register_family(name, config_cls, build_fn).",
        )
        self._archs: Dict[str, Registry[Callable[[], Any]]] = {}

    # ---- registration ----------------------------------------------------------------------

    def register_family(self, name: str, config_cls: type, build_fn: Callable[[Any], Any]) -> Family:
        """Register family `name`: configs are `config_cls` instances, `build_fn(config)` builds a model.

        Raises:
            TypeError: `config_cls` is not a dataclass type or `build_fn` is not callable.
            ValueError: `name` is already registered.
        """
        if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
            raise TypeError(f"family '{name}': config_cls must be a dataclass type, got {config_cls!r}.")
        if not callable(build_fn):
            raise TypeError(f"family '{name}': build_fn must be callable, got {type(build_fn).__name__}.")
        fam = self._families.add(name, Family(name, config_cls, build_fn))
        self._archs[name] = Registry(
            f"{name} architecture",
            hint=f"Register one with @ember.models.arch({name!r}, arch_name) on a function returning a "
            f"{config_cls.__name__}.",
        )
        return fam

    def family(self, name: str, *, config_cls: type) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
        """Decorator form of `register_family` on the build function (or model class)."""

        def deco(build_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            self.register_family(name, config_cls, build_fn)
            return build_fn

        return deco

    def arch(self, family: str, name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
        """Decorator registering a zero-argument function that returns `family`'s config as `name`.

        Raises:
            KeyError: `family` is unknown.
            ValueError: `name` is already registered for `family`.
        """
        archs = self._arch_registry(family)

        def deco(fn: Callable[[], Any]) -> Callable[[], Any]:
            if not callable(fn):
                raise TypeError(f"@arch({family!r}, {name!r}) must decorate a function, got {fn!r}.")
            return archs.add(name, fn)

        return deco

    # ---- lookup ----------------------------------------------------------------------------

    def get_family(self, name: str) -> Family:
        """The registered `Family` called `name` (unknown names list the close matches)."""
        return self._families.get(name)

    def get_config(self, family: str, arch: Optional[str] = None, **overrides: Any) -> Any:
        """The config of architecture `arch` of `family` (or `"family/arch"`), with `overrides` applied.

        Raises:
            KeyError: unknown family or architecture (lists known names and the closest match).
            ValueError: an override names no config field.
            TypeError: the preset function returned something other than the family's config class.
        """
        family, arch = _split(family, arch)
        fam = self.get_family(family)
        cfg = self._arch_registry(family).get(arch)()
        if not isinstance(cfg, fam.config_cls):
            raise TypeError(
                f"architecture '{family}/{arch}' returned {type(cfg).__name__}, expected a "
                f"{fam.config_cls.__name__}."
            )
        return replace_config(cfg, **overrides) if overrides else cfg

    def build_model(self, family: str, arch_or_config: Union[str, Any, None] = None, **overrides: Any) -> Any:
        """Build a model of `family` from an architecture name or a config instance.

        Args:
            family: family name, or `"family/arch"` with `arch_or_config` omitted.
            arch_or_config: architecture name, or an instance of the family's config class.
            **overrides: config fields to change first.

        Raises:
            KeyError: unknown family or architecture.
            TypeError: `arch_or_config` is a config of another class.
        """
        if arch_or_config is None or isinstance(arch_or_config, str):
            family, arch = _split(family, arch_or_config)
            cfg = self.get_config(family, arch, **overrides)
        else:
            fam = self.get_family(family)
            if not isinstance(arch_or_config, fam.config_cls):
                raise TypeError(
                    f"build_model({family!r}, ...) needs an architecture name or a "
                    f"{fam.config_cls.__name__}, got {type(arch_or_config).__name__}."
                )
            cfg = replace_config(arch_or_config, **overrides) if overrides else arch_or_config
        return self.get_family(family).build_fn(cfg)

    def list_families(self) -> List[str]:
        """Registered family names, sorted."""
        return self._families.names()

    def list_archs(self, family: Optional[str] = None) -> List[str]:
        """Architecture names of `family`, or `"family/arch"` for every family when None."""
        if family is not None:
            return self._arch_registry(family).names()
        return [f"{f}/{a}" for f in self.list_families() for a in self._archs[f].names()]

    def _arch_registry(self, family: str) -> Registry[Callable[[], Any]]:
        self._families.get(family)  # raises with close matches when unknown
        return self._archs[family]


def _split(family: str, arch: Optional[str]) -> tuple:
    if arch is None:
        if not isinstance(family, str) or "/" not in family:
            raise ValueError(
                f"no architecture given for {family!r}: pass get_config(family, arch) or 'family/arch', "
                f"e.g. get_config('llama3', 'tiny') or get_config('llama3/tiny')."
            )
        family, arch = family.split("/", 1)
    return family, arch


_DEFAULT = ModelRegistry()

register_family = _DEFAULT.register_family
family = _DEFAULT.family
arch = _DEFAULT.arch
get_config = _DEFAULT.get_config
build_model = _DEFAULT.build_model
list_archs = _DEFAULT.list_archs
list_families = _DEFAULT.list_families
