"""Keep the launchers' console to what a user needs: torch's and XLA's lines that are noise there go.

    quiet_known_noise()   # cli.run_main calls it first, in every launcher and every rank

Each filter matches one known message at its source (a logger, a warning text, an environment
variable read at import), so anything else, a real problem included, is printed as before:

- "No CUDA runtime is found, using CUDA_HOME=..." (logger `torch.utils.cpp_extension`): Inductor's CPU
  code generation imports that module for its C++ include paths; the line is about building CUDA
  extensions, which ember never does, and it came once per process (per rank under torchrun).
- DTensor's "Found a non-scalar tensor with numel=1 and ndim!=0, we are implicitly creating a replicated
  DTensor" (twice per rank): ember's RNG key and counters are one-element tensors, replicated on purpose.
- functorch's "There is a performance drop because we have not yet implemented the batching rule for
  aten::_scaled_dot_product_flash_attention_for_cpu. Please file us an issue on GitHub ..." (once per rank
  of a `pp` run, with the warning's source line): the pipeline runs its stages as one vmap, and CPU flash
  attention has no batching rule, so functorch runs it once per stage, as the stages would run anyway.
- TensorFlow's and XLA's C++ start-up logging in `launch/tpu_pod.py` (`TF_CPP_MIN_LOG_LEVEL`, unless the
  user set it): the GSPMD and "could not open file to read NUMA node" lines at INFO / WARNING level.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

__all__ = ["NOISE", "quiet_known_noise", "quiet_xla_logging"]

NOISE = (
    "No CUDA runtime is found",
    "Found a non-scalar tensor with numel=1 and ndim!=0",
    "There is a performance drop because we have not yet implemented the batching rule for "
    "aten::_scaled_dot_product_flash_attention_for_cpu",
)
"""The start of each message filtered here (tests check that a launcher's stderr holds none of them)."""


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_known_noise() -> None:
    """Filter the known noise above from this process (idempotent)."""
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _DropMessage) for f in cpp_extension.filters):
        cpp_extension.addFilter(_DropMessage(NOISE[0]))
    for start in NOISE[1:]:
        warnings.filterwarnings("ignore", message=re.escape(start), category=UserWarning)


def quiet_xla_logging() -> None:
    """Only errors from TensorFlow / XLA's C++ logging (before torch_xla is imported), unless the user chose."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
