"""ember.launch: the top floor: run configs and the CLI, the loop, metrics files, sharding and checkpoint wiring.

Public names: `TrainConfig`, `register_config`, `get_config`, `list_configs`, `parse_cli`,
`to_dict`, `train_loop`, `evaluate`, `MetricsWriter`, `read_metrics`, `plot_losses`,
`retain_freed_host_memory`, and the modules `build` (model, tokenizer, state and steps of a run
config), `checkpointing`, `sharded`, `cli`, `presets` (the built-in run configs), `report`,
`run_dir` (one process per `--out`), `precision` (compute dtype, TF32, CUDA graph of a run), `interrupt` (Ctrl-C / SIGTERM end a run after its step),
`spmd_run` (the torch_xla run of `tpu_pod.py`), and the package `benchmark` (what `bench.py` measures).

The entry points are scripts in this folder: `train.py`, `tpu_pod.py`, `bench.py`, `ckpt.py`,
`bench_ckpt.py`. Every piece they use is importable here, for a user's own training script.
Nothing else in ember imports `launch`.
"""

from . import build as build
from . import checkpointing as checkpointing
from . import cli as cli
from . import precision as precision
from . import presets as presets
from . import report as report
from . import sharded as sharded
from .host_memory import retain_freed_host_memory as retain_freed_host_memory
from .loop import evaluate as evaluate
from .loop import train_loop as train_loop
from .metrics_log import MetricsWriter as MetricsWriter
from .metrics_log import plot_losses as plot_losses
from .metrics_log import read_metrics as read_metrics
from .run_config import TrainConfig as TrainConfig
from .run_config import get_config as get_config
from .run_config import list_configs as list_configs
from .run_config import parse_cli as parse_cli
from .run_config import register_config as register_config
from .run_config import to_dict as to_dict

__all__ = [
    "MetricsWriter",
    "TrainConfig",
    "build",
    "checkpointing",
    "cli",
    "evaluate",
    "get_config",
    "list_configs",
    "parse_cli",
    "plot_losses",
    "precision",
    "presets",
    "read_metrics",
    "register_config",
    "report",
    "retain_freed_host_memory",
    "sharded",
    "to_dict",
    "train_loop",
]
