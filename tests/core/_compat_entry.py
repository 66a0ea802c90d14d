"""`compiles_entering`: how often one small `jit(backend="inductor")` compile enters a compat patch."""

import torch

from ember.core import jit
from ember.core.jit_backends import traced


def compiles_entering(monkeypatch, patch_name: str) -> int:
    """Times `traced.<patch_name>` (a compat patch's context manager) was entered while `jit` compiled
    `x * 2 + 1` with Inductor; the result is checked too."""
    patch, entered = getattr(traced, patch_name), []

    def recording():
        entered.append(True)
        return patch()

    monkeypatch.setattr(traced, patch_name, recording)
    out = jit(lambda x: x * 2 + 1, backend="inductor")(torch.ones(3))
    torch.testing.assert_close(out, torch.full((3,), 3.0))
    return len(entered)
