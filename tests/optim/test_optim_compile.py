"""ember.optim under `torch.compile(fullgraph=True)`: traces whole, compiles once, never recompiles
on the second update or after `set_hyperparams` (the learning rate is a tensor input, not a
constant baked into the graph), and inductor's numbers match eager.

Costs: one inductor compile (module-scoped fixture, shared by three tests); every optimizer in
OPTIMIZERS_UNDER_TEST is also traced by dynamo with a counting backend that runs the captured
graph eagerly (fast, but still proves fullgraph tracing and the absence of recompiles).
"""

from __future__ import annotations

import pytest
import torch
from optim_testlib import CASE_IDS, OPTIMIZERS_UNDER_TEST, max_abs_diff, mlp_grad, mlp_params
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from ember import optim
from ember.core import pytree


def _step_fn(tx):
    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    return step


def _run(step, tx, n, *, change_at=None, **change):
    """n steps on the MLP; before step `change_at`, `set_hyperparams(state, **change)`."""
    params, state = mlp_params(), tx.init(mlp_params())
    for i in range(n):
        if i == change_at:
            state = optim.set_hyperparams(state, **change)
        params, state = step(mlp_grad(params), state, params)
    return params, state


def _a_settable_hyperparam(tx):
    """{"learning_rate": new value}, or another constant hyperparameter when lr is scheduled."""
    state = tx.init(mlp_params())
    scheduled = {n for node in _inject_nodes(state) for n in node.scheduled}
    name = next(n for n in optim.get_hyperparams(state) if n not in scheduled)
    return {name: 0.5 * optim.get_hyperparams(state)[name].item()}


def _inject_nodes(state):
    is_node = lambda x: isinstance(x, optim.InjectHyperparamsState)  # noqa: E731
    return [n for n in pytree.tree_leaves(state, is_leaf=is_node) if is_node(n)]


@pytest.fixture(scope="module")
def inductor_adamw():
    """adamw compiled by inductor (fullgraph), run 3 steps with an lr change before the third."""
    torch._dynamo.reset()
    tx = optim.chain(
        optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1, mask=optim.decay_mask)
    )
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_step_fn(tx), backend=counter, fullgraph=True)
    params, state = _run(compiled, tx, 3, change_at=2, learning_rate=3e-3)
    eager_params, eager_state = _run(_step_fn(tx), tx, 3, change_at=2, learning_rate=3e-3)
    unchanged_params, _ = _run(_step_fn(tx), tx, 3)
    yield dict(
        frames=counter.frame_count,
        params=params,
        state=state,
        eager_params=eager_params,
        eager_state=eager_state,
        unchanged_params=unchanged_params,
    )
    torch._dynamo.reset()


@pytest.mark.slow  # one inductor compile, shared through the fixture
def test_inductor_compiles_once_across_updates_and_lr_change(inductor_adamw):
    assert inductor_adamw["frames"] == 1


@pytest.mark.slow  # one inductor compile, shared through the fixture
def test_inductor_matches_eager(inductor_adamw):
    assert max_abs_diff(inductor_adamw["params"], inductor_adamw["eager_params"]) < 1e-6
    assert max_abs_diff(inductor_adamw["state"], inductor_adamw["eager_state"]) < 1e-6


@pytest.mark.slow  # one inductor compile, shared through the fixture
def test_lr_change_takes_effect_in_compiled_step(inductor_adamw):
    lr = optim.get_hyperparams(inductor_adamw["state"])["learning_rate"]
    assert lr.item() == pytest.approx(3e-3)
    assert max_abs_diff(inductor_adamw["params"], inductor_adamw["unchanged_params"]) > 1e-5


@pytest.mark.parametrize("case", OPTIMIZERS_UNDER_TEST, ids=CASE_IDS)
def test_traces_fullgraph_and_never_recompiles(case):
    torch._dynamo.reset()  # the step's code object is shared by every case: start clean
    tx = case.make()
    change = _a_settable_hyperparam(tx)
    counter = CompileCounter()
    compiled = torch.compile(_step_fn(tx), backend=counter, fullgraph=True)
    params, _ = _run(compiled, tx, 4, change_at=2, **change)
    assert counter.frame_count == 1, f"recompiled after set_hyperparams({change})"
    eager_params, _ = _run(_step_fn(tx), tx, 4, change_at=2, **change)
    assert max_abs_diff(params, eager_params) == 0.0
    torch._dynamo.reset()
