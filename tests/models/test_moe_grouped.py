"""Dropless experts as sorted pairs and grouped matmuls: the rows, and the same layer as the padded path."""

import dataclasses

import pytest
import torch

from ember.core import pytree, random
from ember.core.compat.grouped_mm import grouped_mm_runs
from ember.core.transforms import grad
from ember.models.layers.moe import MoE
from ember.models.layers.moe_grouped import sort_pairs
from ember.models.layers.moe_router import Router

D, E, I = 16, 6, 8


@pytest.mark.parametrize("align", [1, 4])
def test_each_real_pair_gets_one_row_inside_its_experts_rows_and_padding_gets_none(align):
    N, k = 11, 2
    indices = torch.stack([torch.randperm(E)[:k] for _ in range(N)])  # distinct experts per token
    valid = torch.rand(N) > 0.3
    p = sort_pairs(indices, E, valid, align)
    R = N * k + E * (align - 1)
    assert p.source.shape == (R,) and p.row.shape == (N, k) and p.ends.dtype == torch.int32
    ends = p.ends.tolist()
    starts = [0] + ends[:-1]
    assert all((b - a) % align == 0 for a, b in zip(starts, ends))
    for t in range(N):
        for j in range(k):
            r, e = int(p.row[t, j]), int(indices[t, j])
            if valid[t]:
                assert starts[e] <= r < ends[e] and int(p.source[r]) == t
            else:
                assert r == R
    taken = p.row[valid].flatten()
    assert len(set(taken.tolist())) == taken.numel()  # one row per pair
    assert int((p.source < N).sum()) == taken.numel()  # every other row reads the zero row
    expected = torch.zeros(E).index_add_(0, indices[valid].flatten(), torch.ones(taken.numel()))
    assert torch.equal(p.counts, expected)


def _layers(style: str, k: int):
    router = Router(D, E, k, style=style, renormalize=k > 1, n_groups=2 if style == "sigmoid" else 1,
                    expert_bias=style == "sigmoid", scaling=2.5 if style == "sigmoid" else 1.0)
    grouped = MoE(router, I)
    return grouped, dataclasses.replace(grouped, dropless="padded")


def _loss(moe, x, mask):
    def loss(params, x):
        y, stats = moe.apply(params, x, attention_mask=mask)
        return (y.square().sum() + stats["z"] + (stats["counts"] * stats["probs"]).sum()), stats
    return loss


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("style", ["softmax", "sigmoid"])
def test_grouped_layer_equals_the_padded_layer_with_its_gradients_and_statistics(style, k):
    grouped, padded = _layers(style, k)
    params = grouped.init(random.key(0))
    if style == "sigmoid":
        params["router"]["expert_bias"] = torch.randn(E) * 0.1  # a trained bias
    x = torch.randn(3, 7, D)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[2, 4:] = 0
    (g_grouped, stats_grouped) = grad(_loss(grouped, x, mask), argnums=(0, 1), has_aux=True)(params, x)
    (g_padded, stats_padded) = grad(_loss(padded, x, mask), argnums=(0, 1), has_aux=True)(params, x)
    torch.testing.assert_close(g_grouped, g_padded, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats_grouped, stats_padded, rtol=1e-6, atol=0)
    y_grouped, _ = grouped.apply(params, x, attention_mask=mask)
    y_padded, _ = padded.apply(params, x, attention_mask=mask)
    torch.testing.assert_close(y_grouped, y_padded, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not grouped_mm_runs(torch.bfloat16, "cpu", D, I), reason="no grouped kernel for bf16 here")
def test_grouped_layer_in_bfloat16_is_as_close_to_float32_as_the_padded_layer():
    grouped, padded = _layers("softmax", 2)
    params = grouped.init(random.key(1))
    x = torch.randn(2, 9, D)
    exact, _ = padded.apply(params, x)
    half = pytree.tree_map(lambda t: t.bfloat16(), params)
    err_grouped = (grouped.apply(half, x.bfloat16())[0].float() - exact).abs().max()
    err_padded = (padded.apply(half, x.bfloat16())[0].float() - exact).abs().max()
    assert err_grouped <= 2 * err_padded + 1e-3, (err_grouped, err_padded)


def test_widths_the_kernel_cannot_take_run_padded_with_the_same_result():
    router = Router(6, E, 2)  # 6 floats: rows not a multiple of 16 bytes
    grouped = MoE(router, 5)
    assert not grouped_mm_runs(torch.float32, "cpu", 6, 5)
    params = grouped.init(random.key(2))
    x = torch.randn(2, 4, 6)
    torch.testing.assert_close(grouped.apply(params, x)[0],
                               dataclasses.replace(grouped, dropless="padded").apply(params, x)[0])


def test_an_unknown_dropless_kind_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"MoE.dropless must be one of \('grouped', 'padded'\), got 'sorted'"):
        MoE(Router(D, E, 2), I, dropless="sorted").init(random.key(0))


def test_grouped_slots_compute_the_filled_slots_and_leave_the_empty_ones_zero():
    """Expert parallelism's exchanged buffer: each expert's filled slots (a prefix per group) as grouped rows."""
    from ember.models.layers.moe_grouped import grouped_slots

    torch.manual_seed(0)
    G, E, C, d, I = 3, 4, 5, 16, 8
    params = {"gate": torch.randn(E, I, d), "up": torch.randn(E, I, d), "down": torch.randn(E, d, I)}
    counts = torch.tensor([[5., 0., 2., 7.], [1., 3., 0., 0.], [4., 4., 4., 1.]])  # 7 > C: full
    buffer = torch.randn(G, E, C, d)
    filled = (torch.arange(C) < counts[..., None]).unsqueeze(-1)  # (G, E, C, 1)
    got = grouped_slots(params, buffer, counts)
    gate, up = (torch.einsum("gecd,eid->geci", buffer, params[w]) for w in ("gate", "up"))
    want = torch.einsum("geci,edi->gecd", torch.nn.functional.silu(gate) * up, params["down"])
    torch.testing.assert_close(got, torch.where(filled, want, torch.zeros(())), rtol=1e-5, atol=1e-5)
