"""Fixtures shared by the step_fns tests."""

import pytest
import torch


@pytest.fixture
def assert_single_graph():
    """`check(fn, *args)`: `fn` traces under `torch.compile(fullgraph=True)` into exactly one graph.

    Uses a recording backend that runs the captured graph as is (no Inductor: fast), instead of
    `torch._dynamo.explain`, which resets every compile cache in the process.
    """

    def check(fn, *args, **kwargs):
        graphs = []

        def record(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        out = torch.compile(fn, backend=record, fullgraph=True)(*args, **kwargs)
        assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
        return out

    return check
