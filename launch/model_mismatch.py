"""What differs between a saved model and the run config's, and the command-line flags that give the saved one.

Public names: `refusal`, `FREE_FIELDS`, `LAYOUT_FIELDS`.

    refusal("--init_from runs/a", "checkpoint", "llama3", saved, "llama3", configured, "llama3_tiny")
    # "--init_from runs/a: the checkpoint holds another llama3 model than the run config: n_layers 1 there,
    #  2 configured. To start from it, set --model.n_layers 1."

`--init_from` (`ember.launch.init_from`) and `--resume` (`ember.launch.checkpointing`) refuse a saved
model of another architecture with this one line, before anything is read or written. Starting from
weights loads them into either layer layout; resuming restores the optimizer state too, so there the
layout (`scan_layers`) must be the saved one as well.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, List, Mapping, Optional, Sequence

from ember.core.dataclass_json import to_dict

__all__ = ["FREE_FIELDS", "LAYOUT_FIELDS", "refusal"]

LAYOUT_FIELDS = ("scan_layers",)
"""Config fields that change how the params are laid out (a list of blocks or one stack), not what they mean."""
FREE_FIELDS = LAYOUT_FIELDS + ("remat", "loss_chunk_size", "init_std", "max_seq_len", "dropout")
"""Config fields that may differ from the saved model when starting from its weights."""


def _flag(name: str, value: Any) -> str:
    text = str(value)
    return f"--model.{name} {json.dumps(text) if not text or ' ' in text else text}"


def _differing(saved: Mapping[str, Any], configured: Mapping[str, Any], free: Sequence[str]) -> List[str]:
    """The fields both configs have whose values differ (`free` fields left out)."""
    names = (saved.keys() & configured.keys()) - set(free) - {"__type__"}
    return sorted(n for n in names if saved[n] != configured[n])


def _fix(family: str, saved: Mapping[str, Any], configured_family: str, configured: Mapping[str, Any],
         config_name: Optional[str], free: Sequence[str]) -> str:
    """The command-line flags that give the saved model: `--model.*` on this run config (when it is of the
    saved family and needs at most 3), else the registered run config of that family needing the fewest."""
    from ember.launch.run_config import get_config, list_configs

    same_model = configured_family == family and configured.get("__type__") == saved.get("__type__")
    options = [("", configured)] if same_model else []
    for name in list_configs():
        cfg = get_config(name)
        model = to_dict(cfg.model) if dataclasses.is_dataclass(cfg.model) else {}
        if name != config_name and cfg.family == family and model.get("__type__") == saved.get("__type__"):
            options.append((f"--config {name}", model))
    if not options:  # `--config sft` takes its model from the weights
        return f"pass --config sft (its model is the one saved there) or a {family} run config (`--list-configs`)"
    few = same_model and len(_differing(saved, configured, free)) <= 3  # keep the run config's data and optimizer
    head, model = options[0] if few else min(options, key=lambda option: len(_differing(saved, option[1], free)))
    flags = [head] + [_flag(n, saved[n]) for n in _differing(saved, model, free)
                      if not isinstance(saved[n], (dict, list))]
    if not any(flags):
        return "set the --model.* flags of the run that saved it"
    return f"{'use' if head else 'set'} {' '.join(f for f in flags if f)}"


def refusal(subject: str, where: str, family: str, saved: Mapping[str, Any], configured_family: str,
            configured: Mapping[str, Any], config_name: Optional[str], *, free: Sequence[str] = FREE_FIELDS,
            purpose: str = "start from it") -> Optional[str]:
    """One line naming what differs between the saved and the configured model and the flags to fix it
    (None when they agree on every field outside `free`).

    Args:
        subject: what the line is about (`"--init_from runs/a"`, `"--resume"`).
        where: what holds the saved model (`"folder"`, `"checkpoint"`, `"checkpoint of step 200 in ..."`).
        family, saved: the saved model's family and config dict (`to_dict` of its config dataclass).
        configured_family, configured: the run config's.
        config_name: the run config's name (`--config`), which the fix then does not name again.
        free: fields that may differ.
        purpose: what the flags are for, after "To".
    """
    diffs = [f"{n} {saved[n]} there, {configured[n]} configured" for n in _differing(saved, configured, free)]
    if family == configured_family and not diffs:
        return None
    shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
    if family != configured_family:
        what = f"a {family} model and the run config a {configured_family} one" + (f" ({shown})" if shown else "")
    else:
        what = f"another {family} model than the run config: {shown}"
    return (f"{subject}: the {where} holds {what}. To {purpose}, "
            f"{_fix(family, saved, configured_family, configured, config_name, free)}.")
