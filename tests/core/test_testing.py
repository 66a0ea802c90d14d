"""Tests for `ember.core.testing`: every helper passes on good input and fails with a useful message."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest
import torch
from jaxtyping import Float

from ember.core import pytree, testing
from ember.core.testing import (
    assert_max_compiles,
    assert_pure,
    assert_shape,
    assert_tree_all_finite,
    assert_tree_dtypes,
    assert_tree_shapes,
    assert_trees_all_close,
    assert_trees_all_equal,
    assert_trees_all_equal_structs,
    assert_trees_close,
    check_grads,
    run_on_backends,
    typechecked,
)

NAN, INF = float("nan"), float("inf")


def tree(**overrides):
    base = {"params": {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.zeros(2)}, "step": 3}
    base["params"].update(overrides)
    return base


# -------------------------------------------------------------------------- trees_all_close

CLOSE_PASS = [
    ("identical", tree(), tree()),
    ("within_atol", tree(b=torch.full((2,), 5e-7)), tree()),
    ("other_dtype", tree(b=torch.zeros(2, dtype=torch.float64)), tree()),
    ("nan_same_place", [torch.tensor([NAN, 1.0])], [torch.tensor([NAN, 1.0])]),
    ("numpy_and_numbers", {"a": np.ones(2), "n": 2.0}, {"a": torch.ones(2), "n": 2.0}),
    ("strings", {"name": "x"}, {"name": "x"}),
]


@pytest.mark.parametrize("name,a,b", CLOSE_PASS, ids=[c[0] for c in CLOSE_PASS])
def test_trees_all_close_passes(name, a, b):
    assert_trees_all_close(a, b)


CLOSE_FAIL = [
    (
        "value",
        tree(w=torch.tensor([[1.0, 2.0], [3.0, 4.5]])),
        tree(),
        r"not close at leaf 'params\.w' \(1 of 3 leaves differ[\s\S]*1 of 4 elements differ "
        r"\(rtol=1e-06, atol=1e-06\)[\s\S]*max abs error 0\.5 at index \(1, 1\): 4\.5 \(first\) "
        r"vs 4 \(second\)[\s\S]*max rel error 0\.125[\s\S]*shapes \(2, 2\) vs \(2, 2\); "
        r"dtypes torch\.float32 vs torch\.float32",
    ),
    ("shape", tree(b=torch.zeros(3)), tree(), r"'params\.b'[\s\S]*shapes differ[\s\S]*\(3,\) vs \(2,\)"),
    ("nan_vs_number", tree(b=torch.tensor([0.0, NAN])), tree(), r"'params\.b'[\s\S]*max abs error inf at index \(1,\)"),
    ("inf_vs_inf_sign", [torch.tensor([INF])], [torch.tensor([-INF])], r"leaf '0'"),
    ("missing_key", {"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1)}, r"paths only in the first: \['b'\]; only in the second: \[\]"),
    ("list_vs_tuple", [torch.ones(1)], (torch.ones(1),), r"same leaf paths but different containers"),
    ("python_numbers", {"step": 3}, {"step": 4}, r"leaf 'step'[\s\S]*max abs error 1 at index \(\): 3 \(first\) vs 4"),
    ("python_objects", {"name": "a"}, {"name": "b"}, r"leaf 'name'[\s\S]*values differ: 'a' \(first\) vs 'b'"),
    ("root_tensor", torch.ones(2), torch.zeros(2), r"leaf '<root>'"),
    (
        "lists_other_leaves",
        tree(w=torch.zeros(2, 2), b=torch.ones(2)),
        tree(),
        r"2 of 3 leaves differ[\s\S]*other differing leaves: \['params\.b'\]",
    ),
]


@pytest.mark.parametrize("name,a,b,match", CLOSE_FAIL, ids=[c[0] for c in CLOSE_FAIL])
def test_trees_all_close_fails_naming_the_leaf(name, a, b, match):
    with pytest.raises(AssertionError, match=match):
        assert_trees_all_close(a, b)


def test_tolerances_and_alias():
    a, b = torch.tensor([1.0, 100.0]), torch.tensor([1.05, 101.0])
    assert_trees_close(a, b, rtol=1e-2, atol=0.06)
    assert assert_trees_close is assert_trees_all_close
    with pytest.raises(AssertionError, match=r"rtol=0\.001, atol=0\.06"):
        assert_trees_all_close(a, b, rtol=1e-3, atol=0.06)


def test_bfloat16_and_integer_leaves_compare():
    assert_trees_all_close(torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([1.0, 2.0]))
    with pytest.raises(AssertionError, match=r"dtypes torch\.int64 vs torch\.int64"):
        assert_trees_all_close(torch.tensor([1, 2]), torch.tensor([1, 3]))


# -------------------------------------------------------------------------- trees_all_equal


def test_trees_all_equal():
    assert_trees_all_equal(tree(), tree())
    assert_trees_all_equal([torch.tensor([NAN])], [torch.tensor([NAN])])
    with pytest.raises(AssertionError, match=r"not equal at leaf 'params\.b'[\s\S]*exactly"):
        assert_trees_all_equal(tree(b=torch.tensor([0.0, 1e-9])), tree())
    with pytest.raises(AssertionError, match=r"'params\.b'[\s\S]*dtypes differ"):
        assert_trees_all_equal(tree(b=torch.zeros(2, dtype=torch.float64)), tree())


def test_64_bit_integers_compare_exactly():
    key = torch.tensor(-7046029254386353131)  # an RNG key: float64 would round away the low bits
    assert_trees_all_equal(key, key.clone())
    with pytest.raises(AssertionError, match=r"-7046029254386353131 \(first\) vs -7046029254386353130"):
        assert_trees_all_equal(key, key + 1)
    with pytest.raises(AssertionError, match=r"1 of 1 elements differ"):
        assert_trees_all_close(key, key + 1)
    assert_trees_all_close(torch.tensor([1000]), torch.tensor([1001]), rtol=1e-2)  # small ints: tolerant


def test_dtensor_leaves_are_gathered_first():
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(6.0).reshape(3, 2)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        assert_trees_all_close({"w": sharded}, {"w": full})
        with pytest.raises(AssertionError, match=r"leaf 'w'[\s\S]*max abs error 1 at index \(2, 1\)"):
            assert_trees_all_equal({"w": sharded}, {"w": full + (full == 5).float()})
    finally:
        dist.destroy_process_group()


@pytree.dataclass
class Box:
    x: torch.Tensor
    tag: str = pytree.field(static=True, default="a")


def test_trees_all_equal_structs():
    assert_trees_all_equal_structs(tree(b=torch.ones(5)), tree())
    with pytest.raises(AssertionError, match=r"only in the second: \['params\.c'\]"):
        assert_trees_all_equal_structs(tree(), tree(c=torch.ones(1)))
    with pytest.raises(AssertionError, match=r"different containers or static fields"):
        assert_trees_all_equal_structs(Box(torch.ones(1)), Box(torch.ones(1), tag="b"))


# ------------------------------------------------------------------------------- assert_shape

SHAPES = [
    ((2, 3, 4), (2, 3, 4), True),
    ((2, 3, 4), (2, None, 4), True),
    ((2, 3, 4), (2, ...), True),
    ((2,), (2, ...), True),
    ((3, 4), (..., 4), True),
    ((), (...,), True),
    ((2, 3, 4), (2, ..., 4), True),
    ((2, 3), ({1, 2}, 3), True),
    ((5, 3), ({1, 2}, 3), False),
    ((2, 3), (2,), False),
    ((2, 3, 4), (..., 3), False),
    ((2, 4), (2, ..., 3, 4), False),
    ((2, 3), torch.Size([2, 3]), True),
]


@pytest.mark.parametrize("shape,spec,ok", SHAPES, ids=[f"{s}~{p}" for s, p, _ in SHAPES])
def test_assert_shape_wildcards(shape, spec, ok):
    if ok:
        assert_shape(torch.zeros(shape), spec)
    else:
        with pytest.raises(AssertionError, match=r"expected shape .* got shape"):
            assert_shape(torch.zeros(shape), spec)


def test_assert_shape_lists_every_failing_input():
    with pytest.raises(AssertionError, match=r"expected shape \(2, \*\).*input 1: shape \(3, 1\); input 2: shape \(2,\)"):
        assert_shape([torch.zeros(2, 5), torch.zeros(3, 1), torch.zeros(2)], (2, None))


@pytest.mark.parametrize(
    "spec,exc", [("ab", TypeError), ((1, ..., ...), ValueError), ((True,), TypeError), (({1.5},), TypeError)]
)
def test_assert_shape_rejects_bad_specs(spec, exc):
    with pytest.raises(exc, match="expected shape"):
        assert_shape(torch.zeros(1), spec)


# ------------------------------------------------------------------------- tree shapes/dtypes


def test_assert_tree_shapes():
    t = tree()
    assert_tree_shapes(t["params"], {"w": (2, 2), "b": torch.zeros(2)})
    assert_tree_shapes(t["params"], (..., 2))
    with pytest.raises(AssertionError, match=r"1 leaves have unexpected shapes[\s\S]*'w': shape \(2, 2\), expected \(3, \*\)"):
        assert_tree_shapes(t["params"], {"w": (3, None), "b": (2,)})
    with pytest.raises(AssertionError, match=r"do not match the tree's structure"):
        assert_tree_shapes(t["params"], {"w": (2, 2)})


def test_assert_tree_dtypes():
    t = {"w": torch.zeros(2), "step": torch.tensor(1)}
    assert_tree_dtypes(t, {"w": torch.float32, "step": torch.int64})
    assert_tree_dtypes({"w": torch.zeros(2)}, torch.float32)
    with pytest.raises(AssertionError, match=r"'step': torch\.int64, expected torch\.float32"):
        assert_tree_dtypes(t, torch.float32)


def test_assert_tree_all_finite():
    assert_tree_all_finite({"w": torch.ones(2), "n": torch.tensor(3), "s": "label"})
    bad = {"a": torch.ones(2), "g": {"w": torch.tensor([[1.0, NAN], [INF, 0.0]])}}
    with pytest.raises(
        AssertionError,
        match=r"leaf 'g\.w' has 2 non-finite of 4 elements \(1 NaN, 1 inf\), the first at index "
        r"\(0, 1\); shape \(2, 2\), dtype torch\.float32",
    ):
        assert_tree_all_finite(bad)


# -------------------------------------------------------------------------------- check_grads


def smooth(params, x, n):
    return (torch.tanh(x @ params["w"]) ** 2).sum() * n.float()


def test_check_grads_passes_on_pytrees_with_integer_leaves():
    params = {"w": torch.randn(3, 2)}
    check_grads(smooth, (params, torch.randn(4, 3), torch.tensor(2)))


def half_detached(params, x):
    return (params["w"] * params["w"].detach() * x).sum()  # true gradient 2 w x, autograd sees w x


def test_check_grads_reports_the_wrong_gradient():
    params = {"w": torch.tensor([1.0, 2.0])}
    with pytest.raises(
        AssertionError,
        match=r"w\.r\.t\. args\[0\]\.w does not match finite differences at index \(1,\): "
        r"torch\.func\.grad gives 2, finite differences 4",
    ):
        check_grads(half_detached, (params, torch.ones(2)))


def test_check_grads_bad_input():
    with pytest.raises(ValueError, match=r"0-d tensor, got \(2,\)"):
        check_grads(lambda x: x * 2, torch.ones(2))
    with pytest.raises(ValueError, match=r"no floating tensor"):
        check_grads(lambda n: n.sum(), (torch.tensor([1, 2]),))


# -------------------------------------------------------------------------------- assert_pure


def pure_step(state, batch):
    return {"w": state["w"] - batch}, {"norm": state["w"].norm()}


def test_assert_pure_passes_and_returns_first_output():
    new, metrics = assert_pure(pure_step, {"w": torch.ones(2)}, torch.ones(2))
    assert new["w"].tolist() == [0.0, 0.0] and metrics["norm"].item() == pytest.approx(2**0.5)


def mutating_step(state, batch):
    state["w"].sub_(batch)
    return state


def same_value_inplace_step(state, *, scale):
    return {"w": state["w"].mul_(scale)}


def global_rng_step(state):
    return state + torch.rand(())


PURE_FAIL = [
    ("mutates", mutating_step, ({"w": torch.ones(2)}, torch.ones(2)), {},
     r"modified its input args\[0\]\.w in place during the first call[\s\S]*max abs error 1"),
    ("inplace_same_values", same_value_inplace_step, ({"w": torch.ones(2)},), {"scale": 1.0},
     r"args\[0\]\.w in place[\s\S]*same values, but written in place"),
    ("global_rng", global_rng_step, (torch.zeros(()),), {},
     r"not deterministic[\s\S]*leaf '<root>'"),
]


@pytest.mark.parametrize("name,fn,args,kwargs,match", PURE_FAIL, ids=[c[0] for c in PURE_FAIL])
def test_assert_pure_fails(name, fn, args, kwargs, match):
    with pytest.raises(AssertionError, match=match):
        assert_pure(fn, *args, **kwargs)


def test_assert_pure_names_keyword_inputs():
    def step(x, *, buf):
        buf.add_(1.0)
        return x

    with pytest.raises(AssertionError, match=r"kwargs\['buf'\]"):
        assert_pure(step, torch.ones(1), buf=torch.zeros(1))


# ------------------------------------------------------------------------ assert_max_compiles
# Each test compiles its own function with backend="eager" (dynamo only: fast, no Inductor).


def test_max_compiles_wrapper_passes_for_stable_inputs():
    f = assert_max_compiles(torch.compile(lambda x: x + 1, backend="eager", dynamic=False), n=1)
    for _ in range(3):
        f(torch.ones(4))
    assert f.compiles == 1 and f.calls == 3


def test_max_compiles_names_the_shape_change():
    f = assert_max_compiles(torch.compile(lambda s: s["w"] * 2, backend="eager", dynamic=False), n=1)
    f({"w": torch.ones(2)})
    with pytest.raises(
        AssertionError,
        match=r"at most 1 graph compilation, got 2\. Call 2 compiled again after call 1; between "
        r"them the inputs changed: args\[0\]\.w: shape \(2,\) -> \(3,\)",
    ):
        f({"w": torch.ones(3)})


def test_max_compiles_names_dtype_and_python_value_changes():
    f = assert_max_compiles(torch.compile(lambda x, n: x * n, backend="eager", dynamic=False), n=2)
    f(torch.ones(2), 2)
    f(torch.ones(2, dtype=torch.float64), 2)  # second compilation: still allowed
    with pytest.raises(AssertionError, match=r"got 3\. Call 3 .*args\[1\]: value 2 -> 3.*0-d tensor"):
        f(torch.ones(2, dtype=torch.float64), 3)


def test_max_compiles_counts_ember_jit_graphs():
    from ember.core.jit import jit

    f = assert_max_compiles(jit(lambda x: x * 3, backend="eager"), n=0)
    f(torch.ones(2))  # eager: jit reports 0 compilations
    assert f.compiles == 0


def test_max_compiles_context_manager():
    fn = torch.compile(lambda x: x - 1, backend="eager", dynamic=False)
    with assert_max_compiles(n=1):
        fn(torch.ones(2))
        fn(torch.ones(2))
    with pytest.raises(AssertionError, match=r"at most 0 graph compilations, got 1"):
        with assert_max_compiles(n=0):
            fn(torch.ones(5))


def test_max_compiles_bad_arguments():
    with pytest.raises(TypeError, match=r"with assert_max_compiles\(n=3\)"):
        assert_max_compiles(3)
    with pytest.raises(ValueError, match=r"n must be an int >= 0, got -1"):
        assert_max_compiles(lambda x: x, n=-1)


# ---------------------------------------------------------------------------- run_on_backends


def sgd_step(state, batch):
    grad = 2 * (state["w"] - batch)  # d/dw |w - batch|^2
    new = {"w": state["w"] - 0.1 * grad, "step": state["step"] + 1}
    return new, {"loss": ((state["w"] - batch) ** 2).sum(), "step": new["step"]}


def compile_sensitive_step(state, batch):
    bump = 1.0 if torch.compiler.is_compiling() else 0.0
    return state, {"loss": (state * batch).sum() + bump}


def test_run_on_backends_matches_eager_and_inductor():
    state = {"w": torch.zeros(3), "step": torch.tensor(0)}
    batches = [torch.ones(3), torch.full((3,), 2.0)]
    out = run_on_backends(sgd_step, state, batches, steps=3)
    assert sorted(out) == ["eager", "inductor"]
    final, trajectory = out["inductor"]
    assert len(trajectory) == 3 and int(final["step"]) == 3
    assert [int(m["step"]) for m in trajectory] == [1, 2, 3]
    assert state["w"].tolist() == [0.0, 0.0, 0.0]  # the caller's state is untouched


def test_run_on_backends_reports_the_differing_step():
    with pytest.raises(
        AssertionError,
        match=r"metrics of step 0 differ between backend 'inductor' and 'eager': trees are not "
        r"close at leaf 'loss'",
    ):
        run_on_backends(compile_sensitive_step, torch.ones(2), torch.ones(2))


RUN_ERRORS = [
    ("unknown_backend", dict(backends=("eager", "tpu")), r"unknown backend\(s\) \['tpu'\]; valid choices: \['eager', 'inductor', 'xla'\]"),
    ("no_backends", dict(backends=()), r"backends is empty"),
    ("zero_steps", dict(backends=("eager",), steps=0), r"steps must be >= 1, got 0"),
]


@pytest.mark.parametrize("name,kwargs,match", RUN_ERRORS, ids=[c[0] for c in RUN_ERRORS])
def test_run_on_backends_bad_arguments(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_on_backends(sgd_step, {"w": torch.zeros(1), "step": torch.tensor(0)}, torch.ones(1), **kwargs)


# -------------------------------------------------------------------------------- typechecked


@typechecked
def mix(x: Float[torch.Tensor, "b t d"], w: Float[torch.Tensor, "d e"]) -> Float[torch.Tensor, "b t e"]:
    return x @ w  # (b, t, d) @ (d, e) -> (b, t, e)


def test_typechecked_checks_shapes_eagerly():
    assert mix(torch.ones(2, 3, 4), torch.ones(4, 5)).shape == (2, 3, 5)
    with pytest.raises(TypeError, match=r"parameter 'w'"):
        mix(torch.ones(2, 3, 4), torch.ones(3, 5))
    with pytest.raises(TypeError, match=r"parameter 'x'"):
        mix(torch.ones(3, 4), torch.ones(4, 5))


def test_typechecked_is_skipped_under_torch_compile():
    compiled = torch.compile(lambda x, w: mix(x, w) * 2, backend="eager", fullgraph=True)
    out = compiled(torch.ones(2, 3, 4), torch.ones(4, 5))
    assert out.shape == (2, 3, 5) and out[0, 0, 0].item() == 8.0


# -------------------------------------------------------------------------------- doctests


def test_docstring_examples_run():
    result = doctest.testmod(importlib.import_module("ember.core.testing"))
    assert result.attempted > 20 and result.failed == 0, result


def test_public_names():
    assert sorted(testing.__all__) == testing.__all__
    assert all(callable(getattr(testing, n)) for n in testing.__all__)
