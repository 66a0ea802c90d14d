"""Handing graphs to Inductor: the traced-graph path (`make_fx` + `compile_fx`) and a counting backend.

torch has no public API that takes an ATen graph traced outside Dynamo and compiles it with
Inductor, nor one that counts the graphs a `torch.compile` backend receives (WORKAROUNDS entries
`fake_tracing` and `dynamo_counters`). Everything ember needs for that is here.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import torch

__all__ = [
    "CountingInductor",
    "DataDependentError",
    "cacheable_compile_context",
    "dynamo_graph_count",
    "trace_on_fake_tensors",
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


def trace_on_fake_tensors(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """`make_fx(fn)(*inputs)` on fake tensors, with `torch.compiler.is_compiling()` True meanwhile.

    Raises:
        DataDependentError: `fn` read a tensor's value (`.item()`, `bool(t)`, `if t > 0`).
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    before, torch.compiler._is_compiling_flag = torch.compiler._is_compiling_flag, True
    try:
        gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
    except (GuardOnDataDependentSymNode, DataDependentOutputException) as err:
        raise DataDependentError(str(err).splitlines()[0][:200]) from err
    finally:
        torch.compiler._is_compiling_flag = before
    if any(n.target is torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes):
        raise DataDependentError("a tensor was converted to a Python number")
    return gm


@contextlib.contextmanager
def cacheable_compile_context() -> Iterator[None]:
    """A tracing context whose fake mode has a shape environment, so Inductor and AOTAutograd
    can key a traced graph in their on-disk caches (a second process then loads it)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
        yield


def dynamo_graph_count() -> int:
    """Graphs Dynamo has compiled in this process (all `torch.compile` calls together)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
