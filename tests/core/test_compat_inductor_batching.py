"""jit(backend="inductor") on CPU builds a graph's C++ kernels together in a few libraries, with the
same results, and falls back to one library per kernel when a group does not build."""

import logging

import pytest
import torch

from ember.core.compat import inductor_batching as batching
from ember.core import jit
from ember.core.testing import assert_trees_all_close


def _several_kernels(x, w, scale):
    # A matmul between pointwise chains and reductions: Inductor emits several C++ kernels.
    h = torch.tanh(x * scale) @ w
    return (h.softmax(-1) * 2).sum(0), h.norm(), torch.cumsum(h, 0).exp().mean(1)


def _args(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g), torch.tensor(0.5)


@pytest.fixture
def builds(monkeypatch):
    """The kernel count of every batch built while the test runs."""
    counts = []
    real = batching._Batch.build

    def build(self):
        counts.append(len(self.kernels))
        real(self)

    monkeypatch.setattr(batching._Batch, "build", build)
    return counts


def test_a_graphs_cpu_kernels_are_built_together_with_the_same_results(builds):
    args = _args(0)
    got = jit(_several_kernels)(*args)
    assert builds and builds[0] >= 2, builds  # one build for all of the graph's kernels
    assert_trees_all_close(got, _several_kernels(*args), rtol=1e-5, atol=1e-5)


def test_a_group_that_fails_to_build_falls_back_to_one_library_per_kernel(builds, monkeypatch, caplog):
    monkeypatch.setattr(batching, "combined_source", lambda kernels: "this is not C++;\n")
    args = _args(1)
    with caplog.at_level(logging.WARNING, logger=batching.__name__):
        got = jit(lambda x, w, s: _several_kernels(x + 1, w, s))(*args)
    assert builds and "building them one by one" in caplog.text
    assert_trees_all_close(got, _several_kernels(args[0] + 1, *args[1:]), rtol=1e-5, atol=1e-5)


def _kernel(source, argtypes=("const float*", "float*", "const int64_t")):
    return batching._Kernel(list(argtypes), source)


def test_combined_source_namespaces_each_kernel_and_binds_it_once():
    a = _kernel('#include <cmath>\nextern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t n) {}\n')
    b = _kernel('#include <cmath>\nextern "C" void kernel(const float* in_ptr0, float* out_ptr0, const int64_t n) {}\n')
    src = batching.combined_source([a, b])
    assert src.count("#include <cmath>") == 1
    assert "namespace ember_k0 {" in src and "namespace ember_k1 {" in src and 'extern "C"' not in src
    assert src.count("PyInit_kernel") == 1 and '"kernel_1", kernel_1_py' in src
    assert "ember_k1::kernel(ember_arg<const float*>" not in src  # const is dropped, as Inductor does
    assert "ember_k1::kernel(ember_arg<float*>(args, 0), ember_arg<float*>(args, 1), ember_arg<int64_t>(args, 2))" in src


def test_only_sources_with_one_kernel_entry_are_batched():
    assert batching.batchable('extern "C"  void  kernel(float* x) {}')
    assert not batching.batchable('extern "C" void other(float* x) {}')
    assert not batching.batchable('extern "C" void kernel(float* x) {}\nextern "C" void kernel(int* y) {}')


@pytest.mark.parametrize("groups", [1, 2, 3, 8])
def test_split_evenly_keeps_order_and_balances_source_length(groups):
    kernels = [_kernel("x" * n) for n in (50, 10, 10, 10, 10, 10)]
    split = batching.split_evenly(kernels, groups)
    assert [k for g in split for k in g] == kernels and all(split)
    assert 1 <= len(split) <= min(groups, len(kernels))
    assert split == batching.split_evenly(kernels, groups)
    if groups == 2:
        assert [len(g) for g in split] == [1, 5]
