"""Swap a module's parameters and buffers for given tensors while a block runs, as `functional_call` does.

`torch.func.functional_call` restores the module when the call returns, but a non-reentrant
`torch.utils.checkpoint` inside the module recomputes during the backward, after that, and would
read the module's own weights. torch has no public context manager for the swap, only the private
`torch.nn.utils.stateless._reparametrize_module` that `functional_call` wraps (WORKAROUNDS entry
`module_reparametrize`; pytorch/pytorch#171061 documents it, still private).
"""

from __future__ import annotations

from typing import Any, ContextManager, Dict

import torch
from torch.nn.utils.stateless import _reparametrize_module

__all__ = ["reparametrized"]


def reparametrized(module: torch.nn.Module, tensors: Dict[str, torch.Tensor]) -> ContextManager[Any]:
    """`module` with `tensors` (dotted name -> tensor, tied names tied, every name required) in place."""
    return _reparametrize_module(module, tensors, tie_weights=True, strict=True)
