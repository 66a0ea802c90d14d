"""What a checkpoint says about itself: `CheckpointMeta`, `model_info`, `CheckpointError`.

Private module of `ember.core.checkpoint` (its public names are re-exported there). The metadata
is one JSON object per step (orbax item `meta`): the step, metrics, the run config, the model's
family / arch / config, and a record of every leaf (dotted path, shape, dtype, CRC-32), which
lets a restore check the template before reading any array.

Example:
    >>> info = model_info("gpt2", arch="tiny")
    >>> info["family"], info["arch"]
    ('gpt2', 'tiny')
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..dataclass_json import to_dict
from ._tree import LeafSpec

__all__ = ["CheckpointError", "CheckpointMeta", "model_info"]

FORMAT = "ember-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not fit what it is restored into.

    The message names the directory, the step and what differs, and says how to proceed.
    """


def _ember_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ember")
    except PackageNotFoundError:
        return "unknown"


def model_info(family: str, config: Any = None, *, arch: Optional[str] = None) -> Dict[str, Any]:
    """The model description stored with a checkpoint: family, architecture name, config fields.

    Args:
        family: the model family in the `ember.models` registry (`"llama3"`).
        config: the family's config dataclass (stored as a dict via `ember.core.dataclass_json.to_dict`).
        arch: the named architecture or run config the model came from (`"tiny"`, `"llama3_tiny"`).

    Returns:
        A JSON-serialisable dict `{"family", "arch", "config"}`.
    """
    if not isinstance(family, str) or not family:
        raise TypeError(f"model_info(family=...) must be a non-empty str such as 'llama3', got {family!r}.")
    return {"family": family, "arch": arch, "config": None if config is None else to_dict(config)}


def describe_model(info: Optional[Mapping[str, Any]]) -> str:
    """`llama3 (arch tiny; d_model=128, n_layers=2, ...)` for error messages."""
    if not info:
        return "unknown model (none recorded)"
    cfg = {k: v for k, v in (info.get("config") or {}).items() if k != "__type__"}
    fields = ", ".join(f"{k}={v}" for k, v in cfg.items() if not isinstance(v, dict))
    arch = f"arch {info['arch']}" if info.get("arch") else "no arch name"
    return f"{info.get('family')} ({arch}{'; ' + fields if fields else ''})"


def model_diff(saved: Optional[Mapping[str, Any]], current: Optional[Mapping[str, Any]]) -> List[str]:
    """`["family: 'gpt2' (checkpoint) vs 'llama3'", "config.d_model: 32 vs 64", ...]`."""
    if not saved or not current:
        return []
    out = []
    for key in ("family", "arch"):
        if current.get(key) is not None and saved.get(key) != current.get(key):
            out.append(f"{key}: {saved.get(key)!r} (checkpoint) vs {current.get(key)!r}")
    if saved.get("family") != current.get("family"):
        return out  # configs of two families share few fields: comparing them is noise
    a, b = saved.get("config") or {}, current.get("config") or {}
    if a and b:
        for k in sorted(set(a) | set(b)):
            if a.get(k, "<missing>") != b.get(k, "<missing>"):
                out.append(f"config.{k}: {a.get(k, '<missing>')!r} (checkpoint) vs {b.get(k, '<missing>')!r}")
    return out


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """The metadata of one saved step.

    Attributes:
        step: the training step the checkpoint was saved at.
        metrics: `{name: float}` given to `save` (losses, eval metrics).
        config: the run config as a dict (`ember.core.dataclass_json.to_dict`), or None.
        model: `model_info(...)` of the model, or None.
        leaves: one `LeafSpec` per stored tensor (path, shape, dtype, CRC-32).
        aliases: `{path: path it shares its tensor with}` (tied weights).
        python_leaves: `{path: value}` of leaves that are JSON scalars, not tensors.
        has_data_state: whether a data-iterator state was saved with the step.
        ember_version: the ember version that wrote it.
        saved_at: ISO-8601 UTC time `save` was called.
        format_version: the layout version of ember checkpoints.
    """

    step: int
    metrics: Dict[str, float]
    config: Optional[Dict[str, Any]]
    model: Optional[Dict[str, Any]]
    leaves: Tuple[LeafSpec, ...]
    aliases: Dict[str, str]
    python_leaves: Dict[str, Any]
    has_data_state: bool
    ember_version: str
    saved_at: str
    format_version: int = FORMAT_VERSION

    @property
    def num_elements(self) -> int:
        """Total number of elements over the stored tensors."""
        return sum(leaf.size for leaf in self.leaves)

    def to_json(self) -> Dict[str, Any]:
        """The JSON object stored in the step's `meta` item."""
        d = dataclasses.asdict(self)
        d["leaves"] = [leaf.to_json() for leaf in self.leaves]
        return {"format": FORMAT, **d}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, where: str) -> "CheckpointMeta":
        """Parse the `meta` item; `where` names the step directory in errors."""
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise CheckpointError(
                f"{where} is an orbax checkpoint but not an ember one (its `meta` item has no "
                f"'format': {FORMAT!r}); read it with orbax directly."
            )
        if int(d.get("format_version", 0)) > FORMAT_VERSION:
            raise CheckpointError(
                f"{where} was written in ember checkpoint format {d['format_version']}, newer than this "
                f"ember reads ({FORMAT_VERSION}); upgrade ember (it was written by {d.get('ember_version')})."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["leaves"] = tuple(LeafSpec.from_json(row) for row in d["leaves"])
        return cls(**kw)

    @classmethod
    def build(
        cls,
        *,
        step: int,
        leaves: List[LeafSpec],
        aliases: Dict[str, str],
        python_leaves: Dict[str, Any],
        metrics: Optional[Mapping[str, Any]],
        config: Any,
        model: Optional[Mapping[str, Any]],
        has_data_state: bool,
    ) -> "CheckpointMeta":
        """The metadata of a step being saved (config dataclasses go through `to_dict`)."""
        if config is not None and not isinstance(config, Mapping):
            config = to_dict(config)
        return cls(
            step=step,
            metrics={str(k): float(v) for k, v in (metrics or {}).items()},  # host sync: at save time only
            config=dict(config) if config is not None else None,
            model=dict(model) if model is not None else None,
            leaves=tuple(leaves),
            aliases=dict(aliases),
            python_leaves=dict(python_leaves),
            has_data_state=has_data_state,
            ember_version=_ember_version(),
            saved_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )
