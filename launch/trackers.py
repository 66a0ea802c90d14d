"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow.

Public names: `LogConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["LogConfig"]


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Where a run's metrics go besides `metrics.jsonl` and TensorBoard (`--log.wandb PROJECT`, `--log.mlflow URI`)."""

    wandb: Optional[str] = None
    """Weights & Biases project (offline under WANDB_MODE=offline); needs `pip install "ember[wandb]"`."""
    mlflow: Optional[str] = None
    """MLflow tracking URI, e.g. file:./mlruns; needs `pip install "ember[mlflow]"`."""
