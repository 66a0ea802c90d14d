"""A donated jit(backend="inductor") step frees what it computed from a parameter after the last
read, not after the in-place write of the new parameter at the end of the step."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from ember.core.compat import inductor_frees as _inductor_frees
from ember.core import jit
from ember.core.compat import gated_on, measured_here
from ember.core.testing import assert_trees_all_close


def _step(state, x):
    h = torch.tanh(x @ state["w"])  # the matmul reads w; its output is dead once tanh has run
    return {"w": state["w"] - 0.01 * (x.T @ h)}, h.square().mean()


def _generated_code(fn, *args):
    """Run `fn` with Inductor's caches off and return (result, the wrapper code of its one graph)."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out, codes = run_and_get_code(fn, *args)
    assert len(codes) == 1, len(codes)
    return out, codes[0][codes[0].index("def call(") :]


def _mm_output_freed_before_write(code):
    mm_out = re.search(r"extern_kernels\.mm\(.*out=(buf\d+)\)", code).group(1)
    freed = re.search(rf"\bdel {mm_out}\b|= {mm_out}; del {mm_out}\b", code)
    write = [m.start() for m in re.finditer(r"\n\s*cpp_fused\w*\(.*\barg0_1\b", code)][-1]  # writes w
    return freed is not None and freed.start() < write


GATED, MEASURED = gated_on("frees_after_last_read"), measured_here("frees_after_last_read")


@pytest.mark.parametrize("apply_fix", [True, False])
def test_the_matmul_output_is_freed_before_the_donated_parameter_is_written(apply_fix, monkeypatch):
    """With ember's patches (as gated) the output is freed early; where its need was measured,
    Inductor's own lifetimes free it early exactly where the patch is not gated on. If the plain arm
    fails on a gated torch, that release fixed it: end the range before it (and drop the module once
    no release is left in it). On unmeasured releases only the results are checked."""
    if not apply_fix:
        monkeypatch.setenv("EMBER_DISABLE_PATCHES", "frees_after_last_read")
    w, x = torch.randn(128, 256), torch.randn(64, 128)
    expected_state, expected_loss = _step({"w": w.clone()}, x)
    state = {"w": w.clone()}
    (new_state, loss), code = _generated_code(jit(_step, donate="state"), state, x)
    assert new_state["w"] is state["w"]  # donated: written in place
    assert_trees_all_close((new_state, loss), (expected_state, expected_loss), rtol=1e-5, atol=1e-5)
    if apply_fix and GATED:
        assert _mm_output_freed_before_write(code), code
    elif not apply_fix and MEASURED:
        assert _mm_output_freed_before_write(code) is not GATED, code


def test_graphs_compiled_with_these_lifetimes_have_their_own_cache_key():
    before = torch.compiler.config.cache_key_tag
    with _inductor_frees.frees_after_last_read():
        tag = torch.compiler.config.cache_key_tag
    assert _inductor_frees._CACHE_TAG in tag and tag.startswith(before)
    assert torch.compiler.config.cache_key_tag == before
