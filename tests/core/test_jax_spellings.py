"""JAX's spellings in ember.core: scan(reverse=, unroll=), vmap(axis_name=), tree_reduce / tree_all,
random.PRNGKey / categorical / randint(minval=, maxval=). Each keeps JAX's meaning (checked against
jax itself where cheap) or fails with one line naming what ember supports."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ember.core import pytree, random
from ember.core.transforms import scan, vmap

jax = pytest.importorskip("jax", reason="the JAX references need jax (pip install -e .[test])")
jnp = pytest.importorskip("jax.numpy")

XS = np.linspace(-1.0, 2.0, 15, dtype=np.float32).reshape(5, 3)


def _step(lib):
    """A step whose result depends on the order it sees the xs in (`lib` is torch or jax.numpy)."""
    def step(carry, x):
        carry = carry * 0.5 + lib.tanh(x)
        return carry, {"y": carry * x, "s": carry.sum()}
    return step


@pytest.mark.parametrize("reverse,unroll", [(False, 1), (True, 1), (True, True), (False, 3)])
def test_scan_matches_jax(reverse, unroll):
    carry, ys = scan(_step(torch), torch.zeros(3), torch.from_numpy(XS), reverse=reverse, unroll=unroll)
    want_carry, want_ys = jax.lax.scan(_step(jnp), jnp.zeros(3), jnp.asarray(XS), reverse=reverse, unroll=unroll)
    np.testing.assert_allclose(carry.numpy(), np.asarray(want_carry), rtol=1e-6)
    for name in ("y", "s"):  # ys[i] comes from xs[i] in both directions
        np.testing.assert_allclose(ys[name].numpy(), np.asarray(want_ys[name]), rtol=1e-6, atol=1e-7)


def test_scan_unroll_never_changes_results():
    want = scan(_step(torch), torch.zeros(3), torch.from_numpy(XS), reverse=True)
    for unroll in (False, 0, 2, 5, True):
        got = scan(_step(torch), torch.zeros(3), torch.from_numpy(XS), reverse=True, unroll=unroll)
        assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)))


def test_scan_reverse_with_length_and_no_xs():
    carry, ys = scan(lambda c, _: (c + 1, c), torch.tensor(0), None, length=4, reverse=True)
    want_carry, want_ys = jax.lax.scan(lambda c, _: (c + 1, c), 0, None, length=4, reverse=True)
    assert int(carry) == int(want_carry) and ys.tolist() == np.asarray(want_ys).tolist() == [3, 2, 1, 0]


def test_scan_reverse_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^scan\(reverse=...\) must be a bool, got str 'yes'.$"):
        scan(lambda c, x: (c, None), torch.zeros(()), torch.zeros(3), reverse="yes")


@pytest.mark.parametrize("arg", ["axis_name", "spmd_axis_name"])
def test_vmap_axis_name_says_what_ember_supports(arg):
    want = (f"vmap({arg}='batch') names the mapped axis for collectives (jax.lax.psum / pmean / all_gather "
            f"inside fn), which ember's vmap does not have; drop {arg} and reduce the mapped dim of the output "
            "after vmap instead (e.g. `vmap(fn)(xs).mean(0)`).")
    with pytest.raises(TypeError, match=f"^{re.escape(want)}$"):
        vmap(lambda x: x, **{arg: "batch"})


def test_vmap_axis_name_none_is_jaxs_default():
    assert vmap(lambda x: x * 2, in_axes=0, axis_name=None)(torch.ones(2, 3)).shape == (2, 3)


TREES = [{"a": 1, "b": [2, 3], "c": None}, {"a": True, "b": (True, None)}, {"a": [], "b": {}},
         {"a": 0, "b": [True]}, [None, None]]


@pytest.mark.parametrize("tree", TREES, ids=[str(i) for i in range(len(TREES))])
def test_tree_reduce_and_tree_all_match_jax(tree):
    assert pytree.tree_all(tree) == jax.tree_util.tree_all(tree)
    add = lambda acc, x: acc + int(x)  # noqa: E731
    assert pytree.tree_reduce(add, tree, 100) == jax.tree_util.tree_reduce(add, tree, 100)
    assert pytree.tree_reduce(max, tree, -1) == jax.tree_util.tree_reduce(max, tree, -1)


def test_tree_reduce_on_tensors_stays_traceable():
    tree = {"w": torch.tensor([1.0, -4.0]), "b": torch.tensor([3.0])}
    biggest = lambda t: pytree.tree_reduce(torch.maximum, pytree.tree_map(lambda x: x.abs().max(), t))  # noqa: E731
    assert float(torch.compile(biggest, backend="eager", fullgraph=True)(tree)) == 4.0
    assert pytree.tree_all({"w": torch.tensor(True), "m": [True, 1]}) is True


def test_prngkey_is_key():
    assert torch.equal(random.PRNGKey(7), random.key(7))
    assert torch.equal(random.normal(random.PRNGKey(3), (4,)), random.normal(random.key(3), (4,)))


CATEGORICAL_SHAPES = [  # (logits shape, axis, shape, replace, jax.random.categorical's result shape, jax 0.10.2)
    ((5,), -1, None, True, ()),
    ((4, 3, 5), 1, None, True, (4, 5)),
    ((4, 3, 5), -1, (7, 4, 3), True, (7, 4, 3)),
    ((1, 5), -1, (6, 3), True, (6, 3)),  # a size-1 batch dim broadcasts, as in JAX
    ((4, 6), 1, (3, 4), False, (3, 4)),
    ((6, 2), 0, (5, 2), False, (5, 2)),
]


@pytest.mark.parametrize("logits_shape,axis,shape,replace,want", CATEGORICAL_SHAPES,
                         ids=[f"{c[0]}-axis{c[1]}-{c[2]}-{c[3]}" for c in CATEGORICAL_SHAPES])
def test_categorical_shapes_are_jaxs(logits_shape, axis, shape, replace, want):
    logits = torch.linspace(-1.0, 1.0, int(np.prod(logits_shape))).reshape(logits_shape)
    got = random.categorical(random.key(0), logits, axis=axis, shape=shape, replace=replace)
    assert tuple(got.shape) == want and got.dtype == torch.int64
    assert int(got.min()) >= 0 and int(got.max()) < logits_shape[axis]
    if not replace:  # distinct categories along the sample dim
        flat = got.reshape(got.shape[0], -1)
        assert all(len(set(flat[:, j].tolist())) == flat.shape[0] for j in range(flat.shape[1]))


def test_categorical_draws_softmax_frequencies():
    probs = torch.tensor([0.1, 0.2, 0.0, 0.7])
    draws = random.categorical(random.key(1), torch.log(probs), shape=(20_000,))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[2] == 0  # a -inf logit is never drawn
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)  # about 5 standard errors at n = 20000


def test_categorical_and_randint_trace_whole():
    def draw(k, logits, lo, hi):
        return random.categorical(k, logits, axis=0), random.randint(k, (2, 3), minval=lo, maxval=hi)
    args = (random.key(4), torch.randn(5, 3), torch.tensor(2), torch.tensor([5, 6, 9]))
    for a, b in zip(torch.compile(draw, backend="eager", fullgraph=True)(*args), draw(*args)):
        assert torch.equal(a, b)


def test_randint_takes_jaxs_keywords():
    k = random.key(2)
    by_name = random.randint(k, shape=(50,), minval=-3, maxval=4)
    assert torch.equal(by_name, random.randint(k, (50,), -3, 4)) and by_name.dtype == torch.int64
    assert int(by_name.min()) >= -3 and int(by_name.max()) <= 3
    assert random.randint(k, (3,), 0, 9, dtype=torch.int32).dtype == torch.int32


RANDOM_ERRORS = [  # (id, call, exception, exact message)
    ("randint_empty_range", lambda: random.randint(random.key(0), (2,), minval=3, maxval=3), ValueError,
     "randint needs minval < maxval, got minval=3, maxval=3."),
    ("categorical_bad_shape", lambda: random.categorical(random.key(0), torch.zeros(4, 5), shape=(2, 3)), ValueError,
     "categorical(shape=(2, 3)) must end with a shape the logits' batch shape (4,) broadcasts to (logits (4, 5) "
     "without axis 1); pass shape=(n_samples, *(4,)) or None."),
    ("categorical_too_many_distinct", lambda: random.categorical(random.key(0), torch.zeros(3), shape=(4,),
                                                                 replace=False), ValueError,
     "categorical(replace=False) draws 4 distinct samples (shape (4,)), more than the 3 categories along axis 0; "
     "draw fewer or pass replace=True."),
]


@pytest.mark.parametrize("call,exc,message", [c[1:] for c in RANDOM_ERRORS], ids=[c[0] for c in RANDOM_ERRORS])
def test_random_errors_are_one_line(call, exc, message):
    with pytest.raises(exc, match=f"^{re.escape(message)}$"):
        call()
