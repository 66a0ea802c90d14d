"""The private names behind ember's traced path (`make_fx` on fake tensors, then Inductor) and a counting backend.

torch has no public API that takes an ATen graph traced outside Dynamo and compiles it with
Inductor, nor one that counts the graphs a `torch.compile` backend receives (WORKAROUNDS entries
`fake_tracing` and `dynamo_counters`). `core/jit_backends/trace.py` composes these accessors.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, Tuple

import torch

__all__ = [
    "CountingInductor",
    "compiling_in",
    "data_dependent_errors",
    "dynamo_graph_count",
    "fake_mode",
    "trace_fx",
]


def _inductor_config_error(mode: Optional[str], options: Optional[Dict[str, Any]], err: Exception) -> str:
    msg = str(err)
    if msg.startswith("Unexpected optimization option"):
        from torch._inductor import config

        known = list(config.get_config_copy())
        unknown = [k for k in (options or {}) if k.replace("-", "_") not in known]
        hints = {k: difflib.get_close_matches(k.replace("-", "_"), known, n=3) for k in unknown}
        return (
            f"jit(options=...) has keys Inductor does not know: {unknown} (closest known: {hints}). "
            f"Options are torch._inductor.config names, e.g. {{'max_autotune': True}}."
        )
    first_line = msg.splitlines()[0][:300] if msg else type(err).__name__
    return f"jit(mode={mode!r}, options={options!r}) was rejected by Inductor: {first_line}"


class CountingInductor(torch._TorchCompileInductorWrapper):
    """Inductor as a `torch.compile` backend (and `compile_fx` front) that counts its graphs."""

    def __init__(self, mode: Optional[str], options: Optional[Dict[str, Any]]) -> None:
        try:
            super().__init__(mode, dict(options) if options else None, False)
        except RuntimeError as err:  # unknown mode or option, or an option of the wrong type
            raise ValueError(_inductor_config_error(mode, options, err)) from err
        self.count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.count += 1
        return super().__call__(gm, example_inputs)


def data_dependent_errors() -> Tuple[type, ...]:
    """What tracing raises when the traced function reads a tensor's value (`.item()`, `if t > 0`)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return GuardOnDataDependentSymNode, DataDependentOutputException


def fake_mode(*, shape_env: bool = True) -> Any:
    """A fake mode with a shape environment, for tracing and compiling one graph (see `trace_fx`); without
    one (`shape_env=False`), for running a function on static shapes only (`ember.core.flop_count`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv() if shape_env else None)


def trace_fx(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], mode: Any) -> torch.fx.GraphModule:
    """`make_fx(fn)` on `inputs` made fake in `mode`, under a tracing context of `mode` and with
    `torch.compiler.is_compiling()` True. torch's `scan` and checkpoint operators trace their bodies
    in the caller's fake mode (a second one fails)."""
    from torch._guards import TracingContext, tracing
    from torch.fx.experimental.proxy_tensor import make_fx

    before, torch.compiler._is_compiling_flag = torch.compiler._is_compiling_flag, True
    try:
        with tracing(TracingContext(mode)), mode:
            fake_inputs = [mode.from_tensor(t, static_shapes=True) for t in inputs]
            return make_fx(fn, tracing_mode="real", _allow_non_fake_inputs=True)(*fake_inputs)
    finally:
        torch.compiler._is_compiling_flag = before


def compiling_in(mode: Any) -> ContextManager[Any]:
    """A fresh tracing context of `mode`, for Inductor to compile a graph `trace_fx` traced in it."""
    from torch._guards import TracingContext, tracing

    return tracing(TracingContext(mode))


def dynamo_graph_count() -> int:
    """Graphs Dynamo has compiled in this process (all `torch.compile` calls together)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
