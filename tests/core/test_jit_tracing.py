"""jit(backend="inductor") traces with make_fx per signature: what recompiles and what does not,
values read while tracing fail loudly, and a second process finds the graph in Inductor's disk cache."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ember import optim
from ember.core import TrainState, jit, random
from ember.core.compat import gated_on, measured_here
from isa_probe_counter import COUNT_ISA_PROBES
from ember.core.step_fns import train_step


def _loss(params, batch, *, key):
    return ((batch["x"] @ params["w"] - batch["y"]) ** 2).mean()


def _state(lr=0.1):
    return TrainState.create(params={"w": torch.zeros(3, 2)}, tx=optim.adamw(lr), key=random.key(0))


BATCH = {"x": torch.ones(4, 3), "y": torch.ones(4, 2)}


def test_rebuilt_optimizer_with_same_hyperparameters_reuses_the_graph():
    step = jit(train_step(_loss), donate="state")
    step(_state(), BATCH)
    step(_state(), BATCH)  # a new `tx` (new closures), the same code and hyperparameters
    assert step.compile_count == 1
    step(_state(lr=0.2), BATCH)  # a value in its closures differs: traced again (conservative)
    assert step.compile_count == 2


def test_shape_dtype_and_static_leaf_changes_recompile_values_do_not():
    f = jit(lambda x, scale: x * scale)
    f(torch.ones(3), 2.0)
    f(torch.full((3,), 5.0), 2.0)
    assert f.compile_count == 1
    assert f(torch.ones(4), 2.0).tolist() == [2.0] * 4
    assert f(torch.ones(4, dtype=torch.float64), 2.0).dtype == torch.float64
    assert f(torch.ones(4), 3.0).tolist() == [3.0] * 4
    assert f.compile_count == 4


def test_same_tensor_twice_and_passthrough_outputs():
    f = jit(lambda a, b, c: (a + b, c))
    x, c = torch.ones(2), torch.zeros(2)
    total, same = f(x, x, c)
    assert total.tolist() == [2.0, 2.0] and same is c


def test_is_compiling_is_true_while_tracing():
    seen = []

    def f(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    jit(f)(torch.ones(2))
    assert seen == [True] and not torch.compiler.is_compiling()


@pytest.mark.parametrize("body", ["x * x.sum().item()", "x * 2 if x.sum() > 0 else x"])
def test_reading_a_value_while_tracing_names_the_fix(body):
    f = eval(f"lambda x: {body}")
    with pytest.raises(RuntimeError, match=r"reads a tensor's value .*torch\.where.*backend='eager'"):
        jit(f)(torch.ones(3))


def _graph_reading_a_number_of(source: str) -> torch.fx.GraphModule:
    """What `make_fx` records when a traced function reads a number: the read, unused, its value baked into the
    op that used it (here `x * 6`); the number is read from `arange(4).sum()` or from `x.sum()`."""
    aten, g = torch.ops.aten, torch.fx.Graph()
    x = g.placeholder("x")
    made = g.call_function(aten.arange.default, (4,)) if source == "literal" else x
    g.call_function(aten._local_scalar_dense.default, (g.call_function(aten.sum.default, (made,)),))
    g.output(g.call_function(aten.mul.Tensor, (x, 6)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_numbers_read_from_literals_are_dropped_from_the_graph_and_any_other_refused():
    # DTensor's redistribution planner reads offsets from an `arange` of a size while a step is traced
    from ember.core.jit_backends.trace import DataDependentError, _drop_constant_numbers

    gm = _graph_reading_a_number_of("literal")
    _drop_constant_numbers(gm)
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]  # x * the baked number
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 6.0))
    with pytest.raises(DataDependentError, match="converted to a Python number"):
        _drop_constant_numbers(_graph_reading_a_number_of("input"))


def test_inputs_that_require_grad_go_through_dynamo():
    w = torch.ones(3, requires_grad=True)
    f = jit(lambda w: (w * 2).sum())
    f(w).backward()
    assert w.grad.tolist() == [2.0, 2.0, 2.0] and f.compile_count == 1


_CHILD = COUNT_ISA_PROBES + textwrap.dedent("""
    import json, torch
    from torch._dynamo.utils import counters
    from ember import optim
    from ember.core import TrainState, jit, random
    from ember.core.step_fns import train_step
    from ember.core.transforms import scan
    def loss(params, batch, *, key):  # a rolled loop over stacked layers, as models run theirs
        h, _ = scan(lambda h, w: (torch.tanh(h @ w), None), batch["x"] @ params["w"], params["layers"])
        return ((h - batch["y"]) ** 2).mean()
    params = {"w": torch.full((3, 2), 0.1), "layers": torch.eye(2).repeat(4, 1, 1)}
    state = TrainState.create(params=params, tx=optim.adamw(0.1), key=random.key(0))
    step = jit(train_step(loss), donate="state")
    state, m = step(state, {"x": torch.ones(4, 3), "y": torch.ones(4, 2)})
    print(json.dumps({"loss": m["loss"].item(), "layers": state.params["layers"].flatten().tolist(),
                      "isa_probes": len(probes), **{k: v for k, v in counters["inductor"].items() if "cache" in k},
                      **{k: v for k, v in counters["aot_autograd"].items() if "cache" in k}}))
""")


def test_inductor_caches_no_graph_holding_scan_unless_ember_marks_it_where_gated():
    from torch._higher_order_ops.scan import scan_op

    from ember.core.compat.inductor_scan_cache import scan_graph_cache

    if measured_here("scan_graph_cache"):
        assert scan_op.cacheable() is not gated_on("scan_graph_cache")
    with scan_graph_cache():
        assert scan_op.cacheable()


@pytest.mark.slow
def test_second_process_loads_the_compiled_step_from_the_disk_cache(tmp_path):
    """The step holds a rolled loop: a `scan` in the graph (`compat.inductor_scan_cache`)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold.get("fxgraph_cache_miss") == 1 and "fxgraph_cache_hit" not in cold, cold
    assert warm.get("fxgraph_cache_hit") == 1 and warm.get("autograd_cache_hit") == 1, warm
    assert warm["loss"] == cold["loss"] and warm["layers"] == cold["layers"]
    memo_gated = gated_on("vec_isa_probe_memo")  # where it was measured not needed, torch remembers them
    if memo_gated or measured_here("vec_isa_probe_memo"):
        assert warm["isa_probes"] == 0, "the second process repeated Inductor's ISA checks"
    if memo_gated and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert cold["isa_probes"] > 0 and list((tmp_path / "cache" / "ember").glob("vec_isa_ok.*"))
