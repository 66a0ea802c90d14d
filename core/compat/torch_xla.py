"""torch_xla internals ember reads: targeted sync, runtime state, data ids, shard indices, TPU chips.

torch_xla 2.9.0 (its last release, pytorch/xla#9752) has no public API for cutting a graph whose
outputs are exactly some tensors, for asking whether the runtime started without starting it, for
a tensor's data identity, or for a shard's index (WORKAROUNDS entry `torch_xla_internals`).
torch_xla is imported lazily: `import ember` works without it.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch

__all__ = ["data_id", "is_view", "local_shard_index", "runtime_is_initialized", "sync_tensors",
           "tpu_chip_count"]


def runtime_is_initialized() -> bool:
    """Whether the torch_xla runtime started in this process (never imports torch_xla)."""
    torch_xla = sys.modules.get("torch_xla")
    xlac = getattr(torch_xla, "_XLAC", None)
    return bool(xlac is not None and xlac._xla_runtime_is_initialized())


def sync_tensors(tensors: Sequence[torch.Tensor], *, wait: bool) -> None:
    """Materialise exactly `tensors`: one graph whose outputs are these, whatever else is pending."""
    import torch_xla

    torch_xla._XLAC._xla_sync_multi(list(tensors), devices=[], wait=wait, sync_xla_data=True)


def data_id(t: torch.Tensor) -> Any:
    """An id that changes whenever the tensor's device data or pending IR changes."""
    import torch_xla

    return torch_xla._XLAC._unique_id_for_ir_and_data(t)


def local_shard_index(x: torch.Tensor) -> Any:
    """The index (a tuple of slices, or Ellipsis when replicated) of the first local shard of `x`."""
    import torch_xla

    xlac = torch_xla._XLAC
    if xlac._get_xla_sharding_spec(x) in ("", "{replicated}"):
        return Ellipsis
    return xlac._get_local_shard_replica_and_indices([x])[0][0][1]


def is_view(t: torch.Tensor) -> bool:
    """Whether `t` is a view (its value is an IR node on its base)."""
    return t._is_view()


def tpu_chip_count() -> int:
    """TPU chips attached to this host (0 on a machine without TPUs)."""
    from torch_xla._internal import tpu

    return int(tpu.num_available_chips())

