"""Tests for ember.core.random: determinism, independence, distributions, backends."""

import pytest
import torch

from ember.core import random


def test_same_key_same_numbers_and_split_keys_differ(key):
    assert torch.equal(random.uniform(key, (64,)), random.uniform(key, (64,)))
    k1, k2 = random.split(key)
    assert not torch.equal(random.uniform(k1, (64,)), random.uniform(k2, (64,)))
    assert not torch.equal(random.fold_in(key, 1), random.fold_in(key, 2))
    assert random.split(key, 5).shape == (5,)


def test_split_is_a_pure_function_of_the_key():
    assert torch.equal(random.split(random.key(3), 4), random.split(random.key(3), 4))
    assert not torch.equal(random.key(3), random.key(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform_and_normal_moments(key, dtype):
    u = random.uniform(key, (200_000,), dtype=dtype)
    n = random.normal(key, (200_000,), dtype=dtype)
    assert u.dtype == n.dtype == dtype
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 5e-3
    assert abs(n.mean().item()) < 1e-2 and abs(n.std().item() - 1.0) < 1e-2


def test_uniform_bins_are_flat(key):
    counts = torch.bincount((random.uniform(key, (100_000,)) * 10).long(), minlength=10)
    assert (counts - 10_000).abs().max() < 500  # about 5 sigma of a binomial(1e5, 0.1)


def test_bernoulli_randint_permutation(key):
    assert abs(random.bernoulli(key, 0.3, (100_000,)).float().mean().item() - 0.3) < 5e-3
    r = random.randint(key, (10_000,), 3, 7)
    assert r.min() == 3 and r.max() == 6
    assert sorted(random.permutation(key, 50).tolist()) == list(range(50))


def test_dropout_scales_and_is_reproducible(key):
    x = torch.ones(10_000)
    y = random.dropout(key, x, 0.25)
    assert torch.equal(y, random.dropout(key, x, 0.25))
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.02
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.75))
    assert random.dropout(key, x, 0.25, deterministic=True) is x


def test_bad_inputs_have_clear_errors(key):
    with pytest.raises(TypeError, match=r"random\.key\(seed\)"):
        random.uniform(torch.zeros(()), (2,))
    with pytest.raises(ValueError, match=r"dropout rate must be in \[0, 1\)"):
        random.dropout(key, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="minval < maxval"):
        random.randint(key, (2,), 5, 5)


def _draws(k):
    k1, k2 = random.split(k)
    x = torch.ones(37, 5)  # 185 elements: not a multiple of any vector width
    return random.bits(k1, (185,)), random.uniform(k1, (37, 5)), random.dropout(k2, x, 0.5), random.normal(k2, (37, 5))


def test_compiled_matches_eager_bit_for_bit(key):
    eager = _draws(key)
    compiled = torch.compile(_draws, fullgraph=True, dynamic=False)(key)
    for name, e, c in zip(["bits", "uniform", "dropout"], eager[:3], compiled[:3]):
        assert torch.equal(e, c), name
    # normal goes through erfinv, whose vectorised Inductor kernel may differ by one ulp.
    torch.testing.assert_close(eager[3], compiled[3], rtol=0, atol=1e-6)


def test_normal_is_always_finite():
    # 24 bits + 0.5 used to round to u == 1.0 in float32 (erfinv(1) = inf) about once in 2**24 draws.
    x = random.normal(random.key(1223), (1 << 22,))
    assert torch.isfinite(x).all()
    extreme = torch.tensor([0, (1 << 63) - 1, -1], dtype=torch.int64)  # bit patterns at the ends
    u = (random._srl(extreme, 41).to(torch.float32) + 0.5) * 2.0**-23
    assert (u > 0).all() and (u < 1).all()


def test_fold_in_of_an_int_equals_fold_in_of_the_same_tensor():
    """The int path computes its constant in Python (no tensor constant in a traced body): same bits."""
    key = random.key(7)
    for data in (0, 1, -3, 12345, 2**62 + 11, -(2**63), 2**63 - 1):
        assert torch.equal(random.fold_in(key, data), random.fold_in(key, torch.tensor(data)))
    with pytest.raises(ValueError, match="must fit in int64"):
        random.fold_in(key, 2**63)
