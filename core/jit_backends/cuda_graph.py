"""`jit(..., cuda_graph=True)`: each compiled signature captured whole as one CUDA graph, then replayed.

A pure step with static shapes launches the same kernels on every call; on a GPU the launches of a
small model's step (hundreds of kernels) can cost more than its math. A CUDA graph records them
once and replays them with one launch; torchtitan's graph trainer captures its whole step for this
reason. ember captures the graph Inductor compiled for a signature itself, with torch's public
`torch.cuda.CUDAGraph` (Inductor's own CUDA graphs, `mode="reduce-overhead"`, skip a graph that
writes its inputs, which a donated step does):

- call 1 runs the compiled graph as usual (the warm-up: Triton autotuning and cuBLAS's lazy set-up
  happen then, never inside a capture);
- call 2 records it, then replays it; every later call only replays.

Inputs. A graph reads and writes fixed addresses. The inputs it writes (the donated state's leaves)
are the caller's own tensors at the capture: the state is written back into them and returned, so
a training loop passes the same tensors every call and nothing is copied. Every other input (the
batch) is read from a private copy made at the capture, refreshed from the caller's tensor before
each replay, so the caller's tensors are never written. A donated state given in other tensors than
the captured one (a state restored from a checkpoint) is copied into the captured tensors before the
replay and the result back out after: the captured tensors are the graph's buffers from then on.

Outputs. The graph's own outputs (the metrics; with `donate="none"` the whole new state) live in its
private memory, which the next replay overwrites: each call returns copies of them.

Needs every tensor argument on one CUDA device, and a step without collectives (one process).
"""

from __future__ import annotations

from typing import Any, Callable, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["CudaGraphed", "cuda_graph_refusal", "cuda_graphed", "mutated_inputs"]

_MSG_NOT_ON_CUDA = (
    "jit(cuda_graph=True) replays the step as a CUDA graph, which needs every tensor argument on one "
    "CUDA device, but {what}. Move the state and the batch there first (`ember.core.to_device(tree, "
    "'cuda')`), or drop cuda_graph=True."
)


def cuda_graph_refusal(backend: str, mode: Optional[str], options: Optional[dict]) -> Optional[str]:
    """Why `jit(cuda_graph=True)` cannot be honoured with these arguments on this machine, or None."""
    if backend != "inductor":
        return (f"jit(cuda_graph=True) captures the Inductor-compiled step as a CUDA graph, but backend="
                f"{backend!r} compiles no graph to capture; use backend='inductor' or drop cuda_graph=True.")
    if mode == "reduce-overhead" or (options or {}).get("triton.cudagraphs"):
        return ("jit(cuda_graph=True) captures the whole step itself, and mode='reduce-overhead' / "
                "options={'triton.cudagraphs': True} ask Inductor to capture its own CUDA graphs inside it; "
                "pass only one of them (cuda_graph=True for a donated step).")
    if not torch.cuda.is_available():
        return ("jit(cuda_graph=True) replays the step as a CUDA graph, but torch sees no CUDA GPU here "
                "(torch.cuda.is_available() is False); drop cuda_graph=True on the CPU or torch_xla.")
    return None


def mutated_inputs(gm: torch.fx.GraphModule) -> FrozenSet[int]:
    """Positions of the placeholders of `gm` that an in-place op writes, directly or through a view.

    An ATen op's schema marks the arguments it writes (`Tensor(a!)`) and the results that alias an
    argument (a view, `Tensor(a)`), so this reads only the traced graph's static structure.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    base = {node: i for i, node in enumerate(placeholders)}  # node -> the placeholder it is a view of
    written = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        values = list(node.args) + [node.kwargs.get(a.name) for a in schema.arguments[len(node.args):]]
        for arg, value in zip(schema.arguments, values):
            if arg.alias_info is not None and arg.alias_info.is_write and _is_in(value, base):
                written.add(base[value])
        returns = schema.returns
        first = node.args[0] if node.args else None
        if returns and returns[0].alias_info is not None and _is_in(first, base):
            base[node] = base[first]  # a view (or an in-place op's result) of the same input
    return frozenset(written)


def _check_on_one_cuda_device(inputs: Sequence[Tensor]) -> None:
    devices = {t.device for t in inputs}
    if not inputs:
        raise ValueError(_MSG_NOT_ON_CUDA.format(what="the call has no tensor argument"))
    if len(devices) > 1 or next(iter(devices)).type != "cuda":
        raise ValueError(_MSG_NOT_ON_CUDA.format(what=f"they are on {sorted(map(str, devices))}"))


class CudaGraphed:
    """A compiled graph's callable: run once, then captured as a CUDA graph and replayed (module docstring)."""

    def __init__(self, compiled: Callable[..., Sequence[Tensor]], mutated: FrozenSet[int]) -> None:
        self._compiled = compiled
        self._mutated = frozenset(mutated)
        self._warmed_up = False
        self._graph: Optional[Any] = None
        self._static_inputs: List[Tensor] = []
        self._static_outputs: Tuple[Tensor, ...] = ()

    @property
    def captured(self) -> bool:
        """Whether the CUDA graph has been recorded (from the second call on)."""
        return self._graph is not None

    def __call__(self, *inputs: Tensor) -> Tuple[Tensor, ...]:
        if not self._warmed_up:
            self._check_devices(inputs)
            self._warmed_up = True
            return tuple(self._compiled(*inputs))
        if self._graph is None:
            self._capture(inputs)
        return self._replay(inputs)

    _check_devices = staticmethod(_check_on_one_cuda_device)

    def _capture(self, inputs: Sequence[Tensor]) -> None:
        # written inputs (a donated state) keep the caller's addresses; read-only ones get private buffers
        static_inputs = [t if j in self._mutated else _private_copy(t) for j, t in enumerate(inputs)]
        self._graph, self._static_outputs = self._record(static_inputs)
        self._static_inputs = static_inputs

    def _record(self, static_inputs: List[Tensor]) -> Tuple[Any, Tuple[Tensor, ...]]:
        """The CUDA graph of one call on `static_inputs` (recorded, not run) and its output tensors."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(static_inputs[0].device), torch.cuda.graph(graph):
            static_outputs = tuple(self._compiled(*static_inputs))
        return graph, static_outputs

    def _replay(self, inputs: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        moved = [j for j, (given, static) in enumerate(zip(inputs, self._static_inputs))
                 if given.data_ptr() != static.data_ptr()]
        for j in moved:
            self._static_inputs[j].copy_(inputs[j])
        self._graph.replay()
        for j in moved:
            if j in self._mutated:  # a donated leaf given in a tensor other than the captured one
                inputs[j].copy_(self._static_inputs[j])
        return tuple(t.clone() for t in self._static_outputs)


def cuda_graphed(compiler: Callable[[torch.fx.GraphModule, Sequence[Tensor]], Any]) -> Callable[..., CudaGraphed]:
    """`compiler(gm, inputs)` whose result is replayed as a CUDA graph from its second call on."""

    def compile_and_graph(gm: torch.fx.GraphModule, inputs: Sequence[Tensor]) -> CudaGraphed:
        mutated = mutated_inputs(gm)  # before Inductor, which rewrites the graph it is given
        return CudaGraphed(compiler(gm, inputs), mutated)

    return compile_and_graph


def _private_copy(t: Tensor) -> Tensor:
    """A copy of `t` with its strides (the compiled graph checks them)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _is_in(value: Any, base: dict) -> bool:
    return isinstance(value, torch.fx.Node) and value in base
