"""`foreach_loop_reordering`: a fused node holding a foreach kernel keeps its loops instead of failing."""

import pytest
from _compat_entry import compiles_entering
from torch._inductor.scheduler import FusedSchedulerNode, NopKernelSchedulerNode

from ember.core.compat import gated_on, measured_here
from ember.core.compat.inductor_loop_order import foreach_loop_reordering

GATED, MEASURED = gated_on("foreach_loop_reordering"), measured_here("foreach_loop_reordering")


def _fused_node_holding_another_kind():
    """A fused node whose inner node is not a `SchedulerNode`, as a foreach kernel's are."""
    node = FusedSchedulerNode.__new__(FusedSchedulerNode)
    node.snodes = [NopKernelSchedulerNode.__new__(NopKernelSchedulerNode)]
    return node


@pytest.mark.skipif(not MEASURED, reason="measured on the releases in WORKAROUNDS only")
def test_inductor_fails_to_reorder_such_a_node_exactly_where_gated():
    node = _fused_node_holding_another_kind()
    if GATED:
        with pytest.raises(AssertionError):
            node.reorder_loops_by_dep_pair(None, None)
    else:
        assert node.reorder_loops_by_dep_pair(None, None) is False


def test_within_the_patch_such_a_node_keeps_its_loops_and_the_method_is_restored_after():
    plain = FusedSchedulerNode.reorder_loops_by_dep_pair
    with foreach_loop_reordering():
        assert _fused_node_holding_another_kind().reorder_loops_by_dep_pair(None, None) is False
    assert FusedSchedulerNode.reorder_loops_by_dep_pair is plain


def test_ember_compiles_enter_the_patch_where_gated(monkeypatch):
    assert compiles_entering(monkeypatch, "foreach_loop_reordering") == (1 if GATED else 0)
