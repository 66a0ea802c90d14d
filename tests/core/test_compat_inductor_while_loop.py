"""`while_loop_aliased_carries`: a rolled `scan` whose carry's leaves start as one tensor compiles."""

import pytest
import torch
from _compat_entry import compiles_entering

from ember.core import jit
from ember.core.compat import gated_on, measured_here
from ember.core.transforms import scan

GATED, MEASURED = gated_on("while_loop_aliased_carries"), measured_here("while_loop_aliased_carries")


def _sums(xs, h):
    """Two running sums that start as one zero tensor: Inductor sees one buffer carried twice."""
    zero = torch.zeros(())

    def step(carry, x):
        h, total, squares = carry
        h = torch.tanh(h * x)
        return (h, total + h.sum(), squares + h.pow(2).sum()), None

    return scan(step, (h, zero, zero), xs)[0]


def _inputs():
    return torch.linspace(0.5, 1.5, 6).reshape(6, 1), torch.linspace(-1.0, 1.0, 4)


@pytest.mark.skipif(not MEASURED, reason="measured on the releases in WORKAROUNDS only")
def test_inductor_fails_on_aliased_carries_exactly_where_gated(monkeypatch):
    monkeypatch.setenv("EMBER_DISABLE_PATCHES", "while_loop_aliased_carries")
    plain = jit(lambda xs, h: _sums(xs, h), backend="inductor", options={"fx_graph_cache": False})
    if GATED:
        with pytest.raises(Exception, match="Pointwise"):
            plain(*_inputs())
    else:
        torch.testing.assert_close(plain(*_inputs()), _sums(*_inputs()))


def test_within_the_patch_the_loop_compiles_to_the_plain_numbers():
    compiled = jit(lambda xs, h: _sums(xs, h), backend="inductor", options={"fx_graph_cache": False})
    torch.testing.assert_close(compiled(*_inputs()), _sums(*_inputs()))


def test_ember_compiles_enter_the_patch_where_gated(monkeypatch):
    assert compiles_entering(monkeypatch, "while_loop_aliased_carries") == (1 if GATED else 0)
