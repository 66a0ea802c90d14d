"""`cpp_transpose_indirect_index`: a slice taken at a loaded index, then transposed, compiles on the CPU."""

import pytest
import torch
from _compat_entry import compiles_entering

from ember.core import jit
from ember.core.compat import gated_on, measured_here

GATED, MEASURED = gated_on("cpp_transpose_indirect_index"), measured_here("cpp_transpose_indirect_index")


def _slice_transposed(x, i):
    """Layer `i` of a stack of (16, 2) matrices, transposed: what a rolled layer does with its weights."""
    return (x.index_select(0, i)[0].mT * 2).contiguous()


def _inputs():
    return torch.arange(6 * 2 * 16 * 2, dtype=torch.float32).reshape(6, 2, 16, 2), torch.tensor([3])


def _compiled():
    return jit(_slice_transposed, backend="inductor", options={"fx_graph_cache": False})


@pytest.mark.skipif(not MEASURED, reason="measured on the releases in WORKAROUNDS only")
def test_inductor_fails_on_a_transposed_tile_at_a_loaded_index_exactly_where_gated(monkeypatch):
    monkeypatch.setenv("EMBER_DISABLE_PATCHES", "cpp_transpose_indirect_index")
    if GATED:
        with pytest.raises(Exception, match="was not declared in this scope"):
            _compiled()(*_inputs())
    else:
        assert torch.equal(_compiled()(*_inputs()), _slice_transposed(*_inputs()))


def test_within_the_patch_the_slice_compiles_to_the_plain_numbers():
    assert torch.equal(_compiled()(*_inputs()), _slice_transposed(*_inputs()))


def test_ember_cpu_compiles_enter_the_patch_where_gated(monkeypatch):
    assert compiles_entering(monkeypatch, "transposed_tiles_of_direct_indices") == (1 if GATED else 0)
