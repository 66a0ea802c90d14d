"""Handing graphs to Inductor: the traced-graph path (`make_fx` + `compile_fx`) and a counting backend.

torch has no public API that takes an ATen graph traced outside Dynamo and compiles it with
Inductor, nor one that counts the graphs a `torch.compile` backend receives (WORKAROUNDS entries
`fake_tracing` and `dynamo_counters`). Everything ember needs for that is here.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, Optional, Sequence

import torch

__all__ = [
    "CountingInductor",
    "DataDependentError",
    "dynamo_graph_count",
    "trace_and_compile",
]


class DataDependentError(RuntimeError):
    """The traced function read a tensor's value; `str(err)` is the first line of torch's reason."""


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


def trace_and_compile(fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
                      compile: Optional[Callable[[torch.fx.GraphModule, Sequence[torch.Tensor]], Any]] = None) -> Any:
    """`make_fx(fn)(*inputs)` on fake tensors, then `compile(gm, inputs)` (or `gm` when None).

    One fake mode, owned here with a shape environment, serves tracing and compiling: torch's `scan`
    and checkpoint operators trace their bodies in the caller's fake mode (a second one fails), and
    Inductor resolves their sizes in the same environment; with it, Inductor's FX-graph and
    AOTAutograd caches can key the graph (a second process loads it). Compiling gets a tracing
    context of its own: on torch 2.9, lowering `invoke_subgraph` in the tracing context that traced
    it reuses the undecomposed body ("both a fallback and a decomp"). `torch.compiler.is_compiling()`
    is True while tracing.

    Raises:
        DataDependentError: `fn` read a tensor's value (`.item()`, `bool(t)`, `if t > 0`).
    """
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    before, torch.compiler._is_compiling_flag = torch.compiler._is_compiling_flag, True
    try:
        with tracing(TracingContext(fake_mode)), fake_mode:
            fake_inputs = [fake_mode.from_tensor(t, static_shapes=True) for t in inputs]
            gm = make_fx(fn, tracing_mode="real", _allow_non_fake_inputs=True)(*fake_inputs)
    except (GuardOnDataDependentSymNode, DataDependentOutputException) as err:
        raise DataDependentError(str(err).splitlines()[0][:200]) from err
    finally:
        torch.compiler._is_compiling_flag = before
    if any(n.target is torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes):
        raise DataDependentError("a tensor was converted to a Python number")
    if compile is None:
        return gm
    with tracing(TracingContext(fake_mode)):
        return compile(gm, inputs)


def dynamo_graph_count() -> int:
    """Graphs Dynamo has compiled in this process (all `torch.compile` calls together)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
