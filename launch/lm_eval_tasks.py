"""Standard evaluations through lm-eval-harness: its tasks, run on an ember model.

Public names: `EvalConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["EvalConfig"]


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """lm-eval tasks run during training (`--eval.lm_eval_tasks hellaswag,arc_easy`), every `eval_every` steps."""

    lm_eval_tasks: str = ""
    """Comma-separated lm-eval task names; "": none. Needs `pip install "ember[eval]"`."""
    lm_eval_include_path: Optional[str] = None
    """A folder of local lm-eval task YAML files (lm-eval's --include_path)."""
    lm_eval_limit: Optional[int] = None
    """Documents per task (lm-eval's --limit); None: all."""
