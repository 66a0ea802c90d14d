"""`optim.partition`: each group's state holds its own leaves; it composes with the wrappers; a learning rate
per group in the step's metrics; bad labels get one line naming the fix. Parity with optax's `partition` is in
`test_optax_parity.py`."""

from __future__ import annotations

import pytest
import torch
from optim_testlib import max_abs_diff, mlp_grad, mlp_loss, mlp_params, run_steps

from ember import optim
from ember.core import pytree
from ember.core.step_fns import train_step
from ember.core.train_state import TrainState

GROUPS = {"matrix": optim.adamw(1e-2, weight_decay=0.1), "vector": optim.sgd(5e-2, momentum=0.9)}


def by_rank(tree):
    return pytree.tree_map(lambda x: "matrix" if x.ndim == 2 else "vector", tree)


def test_each_group_holds_state_for_its_own_leaves_only():
    state = optim.partition(GROUPS, by_rank).init(mlp_params())
    sized = sorted(p for p, leaf in pytree.tree_leaves_with_path(state) if leaf.dim() > 0)
    assert sized == [
        "inner_states.matrix.inner_state.inner_state.0.mu.l1.w", "inner_states.matrix.inner_state.inner_state.0.mu.l2.w",
        "inner_states.matrix.inner_state.inner_state.0.nu.l1.w", "inner_states.matrix.inner_state.inner_state.0.nu.l2.w",
        "inner_states.vector.inner_state.inner_state.0.trace.l1.b",
        "inner_states.vector.inner_state.inner_state.0.trace.l2.b",
    ]


def test_a_group_with_the_same_transformation_as_all_equals_it_unpartitioned():
    alone, _ = run_steps(optim.adamw(1e-2), mlp_params(), mlp_grad, 5)
    grouped, _ = run_steps(optim.partition({"a": optim.adamw(1e-2), "b": optim.adamw(1e-2)},
                                           lambda p: pytree.tree_map(lambda x: "a" if x.ndim == 2 else "b", p)),
                           mlp_params(), mlp_grad, 5)
    assert max_abs_diff(alone, grouped) == 0.0


@pytest.mark.parametrize("wrap", ["multi_steps", "apply_if_finite", "masked", "chain"])
def test_partition_composes_with_the_wrappers(wrap):
    inner = optim.partition(GROUPS, by_rank)
    tx = {
        "multi_steps": lambda: optim.multi_steps(inner, every_k=2),
        "apply_if_finite": lambda: optim.apply_if_finite(inner, max_consecutive_errors=2),
        "masked": lambda: optim.masked(inner, lambda p: pytree.tree_map(lambda x: True, p)),
        "chain": lambda: optim.chain(optim.clip_by_global_norm(1.0), inner),
    }[wrap]()
    moved, _ = run_steps(tx, mlp_params(), mlp_grad, 4)
    assert max_abs_diff(moved, mlp_params()) > 1e-4


def test_the_step_reports_a_learning_rate_per_group():
    tx = optim.partition({"matrix": optim.adamw(3e-3), "vector": optim.sgd(optim.linear_schedule(1.0, 0.0, 10))},
                         by_rank)
    state = TrainState.create(params=mlp_params(), tx=tx)
    step = train_step(lambda p, batch, key=None: mlp_loss(p))
    state, first = step(state, {})
    _, metrics = step(state, {})
    assert float(first["lr/vector"]) == 1.0 and float(metrics["lr/vector"]) == pytest.approx(0.9)  # the rate used
    assert float(metrics["lr/matrix"]) == pytest.approx(3e-3)
    assert float(metrics["lr"]) == float(metrics["lr/matrix"])  # the first, as without groups


def test_a_label_naming_no_transformation_is_one_line_naming_the_fix():
    labels = {"l1": {"w": "matrix", "b": "vector"}, "l2": {"w": "matrix", "b": "bias"}}
    with pytest.raises(ValueError, match=r"'l2\.b' is labelled 'bias', which names no transformation.*"
                                         r"\['matrix', 'vector'\].*Add `'bias': <transformation>`"):
        optim.partition(GROUPS, labels).init(mlp_params())


def test_labels_that_do_not_match_the_params_name_the_path():
    with pytest.raises(ValueError, match="param_labels and the params"):
        optim.partition(GROUPS, {"l1": {"w": "matrix", "b": "vector"}}).init(mlp_params())


def test_a_label_that_is_not_a_name_says_what_it_expects():
    with pytest.raises(TypeError, match=r"label of 'l1\.w' is a float .* expected a str or int"):
        optim.partition(GROUPS, lambda p: pytree.tree_map(lambda x: 0.5, p)).init(mlp_params())


def test_transforms_must_be_a_mapping_of_transformations():
    with pytest.raises(TypeError, match="non-empty mapping from label to transformation"):
        optim.partition([optim.sgd(0.1)], by_rank)
    with pytest.raises(TypeError, match=r"partition\(transforms=\{'matrix': \.\.\.\}\)"):
        optim.partition({"matrix": optim.sgd}, by_rank)


def test_a_checkpoint_restores_its_groups_and_refuses_moved_leaves_naming_them(tmp_path):
    """The same groups restore bitwise; a leaf moved to another group is refused before anything is read,
    naming the moved leaf's state on both sides and the fix (the optimizer changed, not the model)."""
    from ember.core.checkpoint import CheckpointError, CheckpointManager

    def state(labels):
        return TrainState.create(params=mlp_params(), tx=optim.partition(GROUPS, labels))

    manager = CheckpointManager(str(tmp_path), save_every=1, async_save=False)
    saved = state(by_rank)
    manager.save(0, saved)
    back, _, _ = manager.restore(0, like=state(by_rank))
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(back.opt_state), pytree.tree_leaves(saved.opt_state)))
    moved = {"l1": {"w": "vector", "b": "vector"}, "l2": {"w": "matrix", "b": "vector"}}
    with pytest.raises(CheckpointError, match=r"(?s)inner_states.vector.*l1.w.*the optimizer differs from the "
                                              r"checkpoint's .* restore the parameters alone \(restore_params\)"):
        manager.restore(0, like=state(moved))
