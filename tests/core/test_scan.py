"""Tests for `ember.core.transforms.scan`, `stack_trees`, `unstack_trees` (core/scan.py)."""

from __future__ import annotations

import pytest
import torch

from ember.core.pytree import tree_leaves, tree_map
from ember.core.transforms import grad, remat, scan, stack_trees, unstack_trees, vmap

WIDTH, HIDDEN, BATCH, DEPTH = 8, 16, 4, 3
TOL = dict(rtol=1e-6, atol=1e-6)  # fp32; the same ops in the same order, unbind/stack aside


def block(p, x):
    return x + torch.nn.functional.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]


def make_layers(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w1": torch.randn(WIDTH, HIDDEN, generator=g) / WIDTH**0.5,
            "b1": torch.randn(HIDDEN, generator=g) * 0.1,
            "w2": torch.randn(HIDDEN, WIDTH, generator=g) / HIDDEN**0.5,
        }
        for _ in range(DEPTH)
    ]


def make_x(seed=1):
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed))


def assert_close(a, b):
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        torch.testing.assert_close(u, v, **TOL)


def loop_loss(layers, x):
    """The reference: an explicit Python loop over per-layer params."""
    for p in layers:
        x = block(p, x)
    return (x**2).mean()


def scan_loss(blk):
    def loss(stacked, x):
        x, _ = scan(lambda h, p: (blk(p, h), None), x, stacked)
        return (x**2).mean()

    return loss


@pytest.mark.parametrize("blk", [block, remat(block)], ids=["plain", "remat"])
def test_scan_over_stacked_layers_matches_python_loop(blk):
    layers, x = make_layers(), make_x()
    stacked = stack_trees(layers)
    assert stacked["w1"].shape == (DEPTH, WIDTH, HIDDEN)

    assert_close(scan_loss(blk)(stacked, x), loop_loss(layers, x))
    g_stacked, g_x = grad(scan_loss(blk), argnums=(0, 1))(stacked, x)
    g_layers, g_x_ref = grad(loop_loss, argnums=(0, 1))(layers, x)
    assert_close((g_stacked, g_x), (stack_trees(g_layers), g_x_ref))


def test_ys_and_pytree_carry_and_xs():
    xs = {"a": torch.arange(4.0), "b": torch.arange(8.0).reshape(4, 2)}

    def f(carry, x):
        total, count = carry
        total = total + x["a"] + x["b"].sum()
        return (total, count + 1), {"running": total, "pair": x["b"] * 2}

    (total, count), ys = scan(f, (torch.tensor(0.0), torch.tensor(0)), xs)
    assert float(total) == 6.0 + 28.0 and int(count) == 4
    torch.testing.assert_close(ys["running"], torch.tensor([1.0, 7.0, 18.0, 34.0]))
    torch.testing.assert_close(ys["pair"], xs["b"] * 2)


def test_no_xs_needs_length():
    carry, ys = scan(lambda c, _: (c * 2, c), torch.tensor(1.0), None, length=3)
    assert float(carry) == 8.0 and ys.tolist() == [1.0, 2.0, 4.0]


def test_none_leaves_pass_through():
    xs = {"a": torch.arange(3.0), "mask": None}
    carry, ys = scan(
        lambda c, x: (c + x["a"], {"y": x["a"], "m": x["mask"]}), torch.tensor(0.0), xs
    )
    assert float(carry) == 3.0 and ys["m"] is None and ys["y"].tolist() == [0.0, 1.0, 2.0]
    assert unstack_trees(xs)[1]["mask"] is None


def test_scan_under_vmap():
    layers, xs = stack_trees(make_layers()), torch.randn(5, BATCH, WIDTH)
    run = lambda x: scan(lambda h, p: (block(p, h), h.sum()), x, layers)  # noqa: E731
    carry, ys = vmap(run)(xs)
    for i in range(5):
        want_carry, want_ys = run(xs[i])
        assert_close((carry[i], ys[i]), (want_carry, want_ys))


SCAN_ERRORS = [
    (
        "leading_dims_differ",
        dict(xs={"a": torch.zeros(3, 2), "b": torch.zeros(4)}),
        ValueError,
        r"xs.a has 3 but xs.b has 4 \(shape \(4,\)\)",
    ),
    ("non_tensor_leaf", dict(xs={"a": torch.zeros(3), "n": 3}), TypeError, r"xs.n is a int"),
    ("zero_d_leaf", dict(xs=torch.tensor(1.0)), ValueError, r"xs.<root> is 0-d"),
    ("no_xs_no_length", dict(xs=None), ValueError, r"pass length=<number of steps>"),
    (
        "length_mismatch",
        dict(xs=torch.zeros(3), length=4),
        ValueError,
        r"length=4 but .* leading dim 3",
    ),
    ("zero_length", dict(xs=torch.zeros(0, 2)), ValueError, r"scan over 0 steps"),
    (
        "unroll_negative",
        dict(xs=torch.zeros(3), unroll=-1),
        ValueError,
        r"scan\(unroll=-1\) must be a bool or an int >= 0, as in jax.lax.scan",
    ),
    ("unroll_float", dict(xs=torch.zeros(3), unroll=2.0), TypeError, r"must be a bool or an int >= 0 .*float 2.0"),
]


@pytest.mark.parametrize(
    "kwargs, exc, match", [c[1:] for c in SCAN_ERRORS], ids=[c[0] for c in SCAN_ERRORS]
)
def test_scan_errors(kwargs, exc, match):
    xs = kwargs.pop("xs")
    with pytest.raises(exc, match=match):
        scan(lambda c, x: (c, None), torch.zeros(()), xs, **kwargs)


def test_carry_must_keep_shape_dtype_and_structure():
    with pytest.raises(
        ValueError,
        match=r"carry leaf '1' changed at step 0: .*"
        r"\(\(\), torch.float32\).*\(\(2,\), torch.float32\)",
    ):
        scan(
            lambda c, x: ((c[0], c[1] + x), None),
            (torch.zeros(()), torch.zeros(())),
            torch.zeros(3, 2),
        )
    with pytest.raises(ValueError, match=r"carry leaf '<root>' changed at step 0.*torch.int64"):
        scan(
            lambda c, x: (c + x, None),
            torch.zeros((), dtype=torch.int32),
            torch.zeros(3, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match=r"carry returned at step 0 has a different structure"):
        scan(lambda c, x: ({"c": c}, None), torch.zeros(()), torch.zeros(3))


def test_stack_unstack_roundtrip():
    layers = make_layers()
    back = unstack_trees(stack_trees(layers))
    assert len(back) == DEPTH
    assert_close(back, layers)
    assert unstack_trees({"w": torch.arange(3.0)})[2]["w"].item() == 2.0


STACK_ERRORS = [
    ("empty", [], ValueError, r"cannot stack an empty list of trees"),
    (
        "not_a_list",
        {"w": torch.zeros(2)},
        TypeError,
        r"trees must be a list or tuple of pytrees, got dict",
    ),
    (
        "structure",
        [{"w": torch.zeros(2)}, {"v": torch.zeros(2)}],
        ValueError,
        r"trees\[1\] has a different structure from trees\[0\]",
    ),
    (
        "shape",
        [{"w": torch.zeros(2)}, {"w": torch.zeros(2)}, {"w": torch.zeros(3)}],
        ValueError,
        r"leaf 'w' is \(2,\) torch.float32 in trees\[0\] but \(3,\) torch.float32 in trees\[2\]",
    ),
    ("non_tensor", [{"w": 1.0}], TypeError, r"trees\[0\].w is a float, not a tensor"),
]


@pytest.mark.parametrize(
    "trees, exc, match", [c[1:] for c in STACK_ERRORS], ids=[c[0] for c in STACK_ERRORS]
)
def test_stack_trees_errors(trees, exc, match):
    with pytest.raises(exc, match=match):
        stack_trees(trees)


def test_stack_trees_errors_end_with_the_callers_fix():
    """A model loader stacking blocks for scan_layers says what to do when they differ."""
    fix = "Blocks that differ cannot be scanned: load with scan_layers=False (a list of blocks)."
    for trees in ([{"w": torch.zeros(2)}, {"v": torch.zeros(2)}], [{"w": torch.zeros(2)}, {"w": torch.zeros(3)}]):
        with pytest.raises(ValueError, match=r"blocks\[1\].*\n?.*scan_layers=False"):
            stack_trees(trees, what="blocks", fix=fix)


def test_unstack_trees_errors():
    with pytest.raises(ValueError, match=r"tree.a has 3 but tree.b has 2"):
        unstack_trees({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"no tensor leaves"):
        unstack_trees({})
    assert tree_map(lambda t: t.shape, unstack_trees({"a": torch.zeros(3, 2)})[0]) == {"a": (2,)}
