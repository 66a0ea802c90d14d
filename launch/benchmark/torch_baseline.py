"""The idiomatic-PyTorch baseline: ember's model as an `nn.Module`, trained with `torch.optim.AdamW`.

Public names: `TorchLM`, `torch_variant`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from ember.core.pytree import tree_flatten, tree_unflatten
from ember.models.layers import as_list

from .setup import Setup, Variant, bench_optim_config, sync


class TorchLM(torch.nn.Module):
    """The ember model as a `torch.nn.Module`: ember params as `nn.Parameter`s, forward = `model.apply` + CE.

    Stacked blocks (`scan_layers`) are unstacked first: the baseline is the list of layers a PyTorch
    model holds (an `nn.ModuleList`), which `torch.compile` unrolls.
    """

    def __init__(self, model: Any, params: Any) -> None:
        super().__init__()
        if getattr(getattr(model, "config", None), "scan_layers", False):
            model, params = as_list(model, params)
        leaves, self._spec = tree_flatten(params)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(t.detach().clone()) for t in leaves])
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model.apply(tree_unflatten(list(self.weights), self._spec), inputs)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def torch_variant(s: Setup, *, compile: bool, impl: str = "auto", autocast: Optional[torch.dtype] = None) -> Variant:
    """`TorchLM` (eager or `torch.compile`d) + `torch.optim.AdamW` (`impl`: auto, fused or foreach)."""
    module = TorchLM(s.model, s.params)
    o = bench_optim_config(s.cfg)
    groups = [{"params": [p for p in module.parameters() if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    kw = dict(lr=o.learning_rate, betas=(o.b1, o.b2), eps=o.eps)
    opt = None
    if impl in ("auto", "fused"):
        try:
            opt, impl = torch.optim.AdamW(groups, fused=True, **kw), "fused"
        except (RuntimeError, ValueError):  # no fused kernel for this device
            if impl == "fused":
                raise
    if opt is None:
        opt, impl = torch.optim.AdamW(groups, foreach=True, **kw), "foreach"
    fwd = torch.compile(module) if compile else module
    params = list(module.parameters())

    def run() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(s.device.type, dtype=autocast, enabled=autocast is not None):
            loss = fwd(s.batch["inputs"], s.batch["targets"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        sync(s.device)
        return loss.detach()

    def state_bytes() -> int:
        held = params + [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in held)

    how = "torch.compile(module)" if compile else "eager module"
    return Variant("", run, state_bytes, clear=lambda: opt.zero_grad(set_to_none=True), device=s.device.type,
                   dtype=str(autocast or torch.float32).replace("torch.", ""),
                   notes=f"{how}, torch.optim.AdamW({impl})" + (f", autocast {autocast}" if autocast else ""))
