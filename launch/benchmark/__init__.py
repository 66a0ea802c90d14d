"""ember.launch.benchmark: the pieces behind `launch/bench.py`, one job per module.

    setup           `Setup` (model, weights, batch) and `Variant` (one way to run the step)
    variants        ember's jitted step per backend, and the registry of named variants
    torch_baseline  idiomatic PyTorch: `TorchLM` + `torch.optim.AdamW`
    jax_baseline    plain JAX + optax on the same weights, and the loss check between the two
    timing          round-robin step timing, the matmul peak
    summary         per-variant statistics, FLOPs per token, machine info: the results dict
    children        measurements that need a fresh process: memory, first call, torch_xla
    report          the BENCHMARKS.md section
    runner          the parent process: time the variants, run the children, report

Example:
    setup = build_setup(get_config("llama3_tiny"), device=torch.device("cpu"))
    timed = time_round_robin([build_variant(n, setup) for n in default_variants(setup.device)],
                             warmup=1, iters=3)
"""

from .children import first_call_child as first_call_child
from .children import memory_child as memory_child
from .children import xla_child as xla_child
from .jax_baseline import initial_losses as initial_losses
from .jax_baseline import jax_loss_fn as jax_loss_fn
from .jax_baseline import jax_params as jax_params
from .report import markdown_section as markdown_section
from .report import update_markdown as update_markdown
from .runner import CHILD_TAG as CHILD_TAG
from .runner import compile_times as compile_times
from .runner import run as run
from .runner import run_child as run_child
from .setup import Setup as Setup
from .setup import Variant as Variant
from .setup import build_setup as build_setup
from .summary import flops_per_token as flops_per_token
from .summary import machine_info as machine_info
from .summary import results as results
from .summary import summarize as summarize
from .timing import matmul_peak as matmul_peak
from .timing import matmul_peaks as matmul_peaks
from .timing import time_round_robin as time_round_robin
from .torch_baseline import TorchLM as TorchLM
from .variants import VARIANTS as VARIANTS
from .variants import build_variant as build_variant
from .variants import default_variants as default_variants

__all__ = [
    "CHILD_TAG",
    "Setup",
    "TorchLM",
    "VARIANTS",
    "Variant",
    "build_setup",
    "build_variant",
    "compile_times",
    "default_variants",
    "first_call_child",
    "flops_per_token",
    "initial_losses",
    "jax_loss_fn",
    "jax_params",
    "machine_info",
    "markdown_section",
    "matmul_peak",
    "matmul_peaks",
    "memory_child",
    "results",
    "run",
    "run_child",
    "summarize",
    "time_round_robin",
    "update_markdown",
    "xla_child",
]
