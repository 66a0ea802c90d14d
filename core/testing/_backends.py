"""Running one step function on several `ember.core.jit` backends and comparing the results.

Public names: `run_on_backends`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..pytree import tree_map
from ..types import PyTree
from ._compare import _to_cpu
from ._trees import assert_trees_all_close

Backend = Literal["eager", "inductor", "xla"]
_BACKENDS = ("eager", "inductor", "xla")


def _backend_device(backend: str) -> torch.device:
    if backend != "xla":
        return torch.device("cpu")
    from .. import xla

    return xla.start_runtime("run_on_backends(backends=(..., 'xla'))")


def run_on_backends(
    step: Callable[..., Tuple[Any, Any]],
    state: Any,
    batch_or_batches: Any,
    *,
    backends: Sequence[Backend] = ("eager", "inductor"),
    steps: Optional[int] = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> Dict[str, Tuple[Any, List[Any]]]:
    """Run one step function through `ember.core.jit` on several backends and compare them.

    Each backend starts from its own copy of `state` (on `torch_xla.device()` for `"xla"`, whose
    runtime it starts: any earlier backward pass, e.g. in another test, is harmless) and runs
    `steps` steps; metrics of every step and the final states are brought to CPU and
    compared with the first backend's within `rtol`/`atol`.

    Args:
        step: `step(state, batch) -> (state, metrics)`, pure.
        state: the initial state (a pytree; not modified).
        batch_or_batches: one batch used for every step, or a `list` of batches used in order
            (cycled if shorter than `steps`). Any non-list (a dict, a tuple) is one batch.
        backends: backends of `ember.core.jit` to run, compared against the first one.
        steps: number of steps; defaults to the number of batches (1 for a single batch).
        rtol: relative tolerance for metrics and final states.
        atol: absolute tolerance for metrics and final states.

    Returns:
        `{backend: (final_state, [metrics of each step])}`, all on CPU.

    Raises:
        AssertionError: naming the step, both backends and the first differing leaf.
        ValueError: an unknown backend (listing the valid ones), no backends, or `steps < 1`.
        ImportError: `"xla"` requested without torch_xla installed.

    Example:
        >>> import torch
        >>> from ember.core.testing import run_on_backends
        >>> def step(state, batch):
        ...     new = {"w": state["w"] - 0.1 * batch}
        ...     return new, {"w_norm": new["w"].norm()}
        >>> out = run_on_backends(step, {"w": torch.ones(2)}, torch.ones(2), backends=("eager",))
        >>> out["eager"][1][0]["w_norm"].item() == torch.full((2,), 0.9).norm().item()
        True
    """
    from ..jit import jit

    backends = tuple(backends)
    if not backends:
        raise ValueError(f"run_on_backends: backends is empty; choose from {list(_BACKENDS)}.")
    unknown = [b for b in backends if b not in _BACKENDS]
    if unknown:
        raise ValueError(
            f"run_on_backends: unknown backend(s) {unknown}; valid choices: {list(_BACKENDS)}."
        )
    batches = batch_or_batches if isinstance(batch_or_batches, list) else [batch_or_batches]
    if not batches:
        raise ValueError("run_on_backends: the list of batches is empty.")
    steps = len(batches) if steps is None else steps
    if steps < 1:
        raise ValueError(f"run_on_backends: steps must be >= 1, got {steps}.")

    def to(tree: PyTree, device: torch.device) -> PyTree:
        return tree_map(lambda t: t.detach().clone().to(device) if isinstance(t, Tensor) else t, tree)

    # Start every device before the first step: the XLA runtime then sizes autograd's device
    # queues if no backward ran yet (else jit runs XLA backward passes under xla.autograd_guard).
    devices = {backend: _backend_device(backend) for backend in backends}
    results: Dict[str, Tuple[Any, List[Any]]] = {}
    for backend in backends:
        device = devices[backend]
        fn = jit(step, backend=backend)
        current = to(state, device)
        trajectory = []
        for i in range(steps):
            current, metrics = fn(current, to(batches[i % len(batches)], device))
            trajectory.append(tree_map(_to_cpu, metrics))  # host sync: a test helper, not a step
        results[backend] = (tree_map(_to_cpu, current), trajectory)

    ref = backends[0]
    for backend in backends[1:]:
        for i in range(steps):
            _compare_labelled(
                results[ref][1][i], results[backend][1][i], rtol, atol,
                f"metrics of step {i} differ between backend '{backend}' and '{ref}'",
            )
        _compare_labelled(
            results[ref][0], results[backend][0], rtol, atol,
            f"final states after {steps} steps differ between backend '{backend}' and '{ref}'",
        )
    return results


def _compare_labelled(ref: PyTree, got: PyTree, rtol: float, atol: float, label: str) -> None:
    try:
        assert_trees_all_close(got, ref, rtol=rtol, atol=atol)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None
