"""Tests for `ember.core.transforms`: grad / value_and_grad against `torch.autograd.grad`,
their misuse errors, and vmap. remat and scan have their own files (test_remat.py, test_scan.py)."""

from __future__ import annotations

import pytest
import torch

from ember.core.pytree import tree_leaves, tree_map
from ember.core.transforms import grad, value_and_grad, vmap

TOL = dict(rtol=1e-6, atol=1e-6)  # fp32; functorch and autograd run the same backward ops


def make_mlp(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {
        "w1": torch.randn(5, 7, generator=g) / 5**0.5,
        "b1": torch.zeros(7),
        "w2": torch.randn(7, 3, generator=g) / 7**0.5,
        "b2": torch.randn(3, generator=g) * 0.1,
    }
    x = torch.randn(6, 5, generator=g)
    y = torch.randn(6, 3, generator=g)
    return params, x, y


def mlp(params, x):
    return torch.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss(params, x, y):
    return ((mlp(params, x) - y) ** 2).mean()


def loss_with_aux(params, x, y):
    out = mlp(params, x)
    return ((out - y) ** 2).mean(), {"out_mean": out.mean(), "n": torch.tensor(out.shape[0])}


def reference(params, x, y, *, wrt_x=False):
    """Loss and gradients by ordinary autograd."""
    p = tree_map(lambda t: t.detach().clone().requires_grad_(), params)
    xr = x.detach().clone().requires_grad_(wrt_x)
    value = loss(p, xr, y)
    inputs = list(p.values()) + ([xr] if wrt_x else [])
    grads = torch.autograd.grad(value, inputs)
    g_params = dict(zip(p.keys(), grads[: len(p)]))
    return value.detach(), g_params, (grads[-1] if wrt_x else None)


def assert_close(a, b):
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        torch.testing.assert_close(u, v, **TOL)


def test_grad_matches_autograd():
    params, x, y = make_mlp()
    _, want, _ = reference(params, x, y)
    assert_close(grad(loss)(params, x, y), want)


def test_value_and_grad_matches_autograd():
    params, x, y = make_mlp()
    want_v, want_g, _ = reference(params, x, y)
    value, grads = value_and_grad(loss)(params, x, y)
    assert value.shape == () and grads.keys() == params.keys()
    assert_close((value, grads), (want_v, want_g))


def test_has_aux_grad_and_value_and_grad():
    params, x, y = make_mlp()
    want_v, want_g, _ = reference(params, x, y)
    want_aux = {"out_mean": mlp(params, x).mean(), "n": torch.tensor(6)}

    grads, aux = grad(loss_with_aux, has_aux=True)(params, x, y)
    assert_close((grads, aux), (want_g, want_aux))

    (value, aux), grads = value_and_grad(loss_with_aux, has_aux=True)(params, x, y)
    assert_close((value, aux, grads), (want_v, want_aux, want_g))
    assert aux["n"].dtype == torch.int64  # aux passes through untouched


@pytest.mark.parametrize("argnums", [(0, 1), (-3, -2)], ids=["positive", "negative"])
def test_argnums_tuple(argnums):
    params, x, y = make_mlp()
    want_v, want_g, want_gx = reference(params, x, y, wrt_x=True)
    g_params, g_x = grad(loss, argnums=argnums)(params, x, y)
    assert_close((g_params, g_x), (want_g, want_gx))
    value, (g_params, g_x) = value_and_grad(loss, argnums=argnums)(params, x, y)
    assert_close((value, g_params, g_x), (want_v, want_g, want_gx))


def test_kwargs_pass_through_undifferentiated(key):
    params, x, y = make_mlp()

    def keyed(params, x, y, *, key, scale=1.0):
        assert key.dtype == torch.int64
        return loss(params, x, y) * scale

    _, want, _ = reference(params, x, y)
    assert_close(grad(keyed)(params, x, y, key=key, scale=2.0), tree_map(lambda g: 2 * g, want))


def test_functools_wraps_keeps_name():
    assert grad(loss).__name__ == "loss" and value_and_grad(loss).__name__ == "loss"


# (id, function returning the wrong thing, has_aux, exception, message pattern)
MISUSE_CASES = [
    (
        "aux_not_a_tuple",
        lambda w: (w**2).sum(),
        True,
        TypeError,
        r"has_aux=True, `.*` must return a pair `\(loss, aux\)`.*"
        r"it returned a Tensor of shape \(\)",
    ),
    (
        "aux_tuple_of_3",
        lambda w: ((w**2).sum(), w, w),
        True,
        TypeError,
        r"it returned a tuple of length 3 \(Tensor, Tensor, Tensor\).*Return the pair",
    ),
    (
        "aux_list",
        lambda w: [(w**2).sum(), w],
        True,
        TypeError,
        r"it returned a list",
    ),
    (
        "tuple_without_has_aux",
        lambda w: ((w**2).sum(), {"m": w.mean()}),
        False,
        TypeError,
        r"returned a tuple of length 2, but has_aux=False.*pass has_aux=True",
    ),
    (
        "non_scalar",
        lambda w: w * 2,
        False,
        ValueError,
        r"must return a 0-d \(scalar\) loss tensor; the returned value has shape \(4, 3\)"
        r".*\.mean\(\)",
    ),
    (
        "non_scalar_with_aux",
        lambda w: (w.sum(0), None),
        True,
        ValueError,
        r"the first element of the returned pair has shape \(3,\)",
    ),
    (
        "one_element_not_0d",
        lambda w: w.sum().reshape(1),
        False,
        ValueError,
        r"has shape \(1,\)",
    ),
    (
        "python_float",
        lambda w: 1.0,
        False,
        TypeError,
        r"must return a 0-d floating-point loss tensor; the returned value is a float",
    ),
    (
        "integer_loss",
        lambda w: (w > 0).sum(),
        False,
        TypeError,
        r"must return a floating-point loss; the returned value has dtype torch.int64.*\.float\(\)",
    ),
]


@pytest.mark.parametrize("transform", [grad, value_and_grad], ids=["grad", "value_and_grad"])
@pytest.mark.parametrize(
    "fn, has_aux, exc, match", [c[1:] for c in MISUSE_CASES], ids=[c[0] for c in MISUSE_CASES]
)
def test_misuse_errors(transform, fn, has_aux, exc, match):
    with pytest.raises(exc, match=match):
        transform(fn, has_aux=has_aux)(torch.ones(4, 3))


@pytest.mark.parametrize(
    "argnums, exc, match",
    [
        ("0", TypeError, r"argnums must be an int or a tuple of ints, got '0'"),
        ([0, 1], TypeError, r"argnums must be an int or a tuple of ints, got \[0, 1\] \(list\)"),
        ((0, 1.0), TypeError, r"argnums must be a tuple of ints, got \(0, 1.0\)"),
        ((), ValueError, r"argnums=\(\) differentiates nothing"),
        ((0, 0), ValueError, r"argnums \(0, 0\) repeats an index"),
    ],
    ids=["str", "list", "float", "empty", "repeat"],
)
def test_bad_argnums(argnums, exc, match):
    with pytest.raises(exc, match=match):
        grad(loss, argnums=argnums)


def test_argnums_out_of_range_names_the_call():
    params, x, y = make_mlp()
    with pytest.raises(
        ValueError, match=r"argnums=\(0, 3\) refers to positional argument 3.*called with 3"
    ):
        value_and_grad(loss, argnums=(0, 3))(params, x, y)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"w": torch.ones(2), "scale": 0.5}, r"leaf 'scale' of positional argument 0 is a float"),
        (
            {"w": torch.ones(2), "ids": torch.arange(2)},
            r"leaf 'ids' .* integer/bool tensor of dtype torch.int64",
        ),
        (
            torch.arange(2),
            r"the positional argument 0 is an integer/bool tensor of dtype torch.int64",
        ),
    ],
    ids=["python_float", "int_tensor", "int_root"],
)
def test_non_float_leaf_in_differentiated_arg(params, match):
    with pytest.raises(TypeError, match=match):
        grad(lambda p: sum(t.float().sum() for t in tree_leaves(p)))(params)


def test_vmap_per_example_grads_match_loop():
    params, x, y = make_mlp()
    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x[:, None], y[:, None])
    for i in range(x.shape[0]):
        _, want, _ = reference(params, x[i : i + 1], y[i : i + 1])
        assert_close({k: g[i] for k, g in per_example.items()}, want)


def test_vmap_out_dims_and_randomness_choices():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(vmap(lambda r: r * 2, out_dims=1)(x), (x * 2).T)
    same = vmap(lambda r: r + torch.rand(()), randomness="same")(torch.zeros(4))
    assert torch.all(same == same[0])
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(lambda r: r + torch.rand(()))(torch.zeros(4))  # default "error": use ember keys


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(randomness="random"),
            r"randomness must be one of 'error', 'different', 'same', got 'random'",
        ),
        (dict(chunk_size=0), r"chunk_size must be a positive int or None, got 0"),
    ],
    ids=["randomness", "chunk_size"],
)
def test_vmap_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vmap(lambda r: r, **kwargs)


def test_vmap_takes_jax_spellings_in_axes_and_out_axes():
    w, xs = torch.tensor([1.0, 2.0]), torch.arange(6.0).reshape(3, 2)
    f = lambda w, x: (w * x, w.sum())  # noqa: E731
    want = vmap(f, in_dims=(None, 0), out_dims=(1, None))(w, xs)
    for got in (vmap(f, in_axes=(None, 0), out_axes=(1, None))(w, xs),
                vmap(f, in_axes=[None, 0], out_axes=(1, None))(w, xs)):  # JAX reads a top-level list as a tuple
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0].shape == (2, 3)
    tree = vmap(lambda d: d["a"] + d["b"], in_axes=({"a": 0, "b": None},))({"a": xs, "b": w})  # a pytree prefix
    assert torch.equal(tree, xs + w)
    with pytest.raises(ValueError, match=r"vmap got both in_dims=1 and in_axes=0.*in_axes is JAX's spelling of in_dims"):
        vmap(f, 1, in_axes=0)
    with pytest.raises(ValueError, match=r"vmap got both out_dims=1 and out_axes=0"):
        vmap(f, out_dims=1, out_axes=0)
