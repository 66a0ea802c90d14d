"""`chunked_cross_entropy` equals the plain loss (value and gradients) without whole logits.

Eager and compiled (Inductor, fullgraph) here; torch_xla SPMD and DTensor with a vocab-sharded head
in `test_mesh_parity.py`. The memory it saves is measured by `launch/bench_scale.py`.
"""

import pytest
import torch

from ember import optim
from ember.core import TrainState, random
from ember.core.jit import jit
from ember.core.pytree import tree_leaves_with_path
from ember.core.step_fns import chunked_cross_entropy, cross_entropy, eval_step, train_step
from ember.core.transforms import value_and_grad
from ember.models import build_model, lm_loss

N, T, D, V = 3, 10, 8, 50


def linear_head(p, h):
    return h @ p["weight"].T


def make_inputs(seed=0, all_ignored=False):
    k = random.split(random.key(seed), 3)
    params = {"weight": random.normal(k[0], (V, D)) * 0.3, "hidden": random.normal(k[1], (N, T, D))}
    labels = random.randint(k[2], (N, T), 0, V)
    labels[0, :4] = -100
    return params, torch.full_like(labels, -100) if all_ignored else labels


def plain_loss(labels, z_loss):
    def f(p):
        logits = linear_head({"weight": p["weight"]}, torch.tanh(p["hidden"]))
        return cross_entropy(logits, labels, z_loss=z_loss, reduction="sum_and_count").total * 0.5
    return f


def chunked_loss(labels, z_loss, chunk_size):
    def f(p):
        hidden = torch.tanh(p["hidden"])  # something upstream to differentiate through
        return chunked_cross_entropy(linear_head, {"weight": p["weight"]}, hidden, labels,
                                     chunk_size=chunk_size, z_loss=z_loss).total * 0.5
    return f


def assert_same(a, b, tol=1e-5):
    (va, ga), (vb, gb) = a, b
    torch.testing.assert_close(vb, va, rtol=tol, atol=tol)
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize("chunk_size", [1, 7, 10, 30, 1000])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_matches_plain_loss_and_gradients(chunk_size, z_loss):
    params, labels = make_inputs()
    assert_same(value_and_grad(plain_loss(labels, z_loss))(params),
                value_and_grad(chunked_loss(labels, z_loss, chunk_size))(params))


def test_all_ignored_gives_zero_loss_and_gradients():
    params, labels = make_inputs(all_ignored=True)
    value, grads = value_and_grad(chunked_loss(labels, 1e-3, 7))(params)
    assert float(value) == 0.0 and all(bool((g == 0).all()) for g in grads.values())


def test_compiled_fullgraph_matches_eager(assert_single_graph):
    params, labels = make_inputs(1)
    fn = value_and_grad(chunked_loss(labels, 1e-3, 7))
    assert_single_graph(fn, params)
    assert_same(fn(params), torch.compile(fn, fullgraph=True)(params))


def test_without_gradients_it_only_reduces():
    params, labels = make_inputs(2)
    with torch.no_grad():
        torch.testing.assert_close(chunked_loss(labels, 1e-3, 7)(params), plain_loss(labels, 1e-3)(params))


def test_bad_chunk_size_and_shapes_name_the_fix():
    params, labels = make_inputs()
    with pytest.raises(ValueError, match=r"chunk_size must be an int >= 1, got 0"):
        chunked_cross_entropy(linear_head, params, params["hidden"], labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"hidden must be labels.shape \+ \(d,\); got hidden \(3, 10, 8\) and labels \(3, 9\)"):
        chunked_cross_entropy(linear_head, params, params["hidden"], labels[:, 1:])


TINY = dict(vocab_size=96, d_model=32, n_heads=4, n_layers=2, max_seq_len=16)


FAMILIES = {"llama3": ("llama3", dict(n_kv_heads=2, ffn_dim=64)),
            "llama3_tied": ("llama3", dict(n_kv_heads=2, ffn_dim=64, tie_embeddings=True)),
            "gpt2": ("gpt2", {})}


# Compiled: an untied and a tied head (GPT-2's head is tied too: eager covers it).
@pytest.mark.parametrize("backend,name", [*(("eager", f) for f in FAMILIES),
                                          *(pytest.param("inductor", f, marks=pytest.mark.slow)
                                            for f in ("llama3", "llama3_tied"))])
def test_model_config_asks_for_it_and_the_step_is_unchanged(backend, name):
    family, extra = FAMILIES[name]
    plain = build_model(family, "tiny", **TINY, **extra)
    chunked = build_model(family, "tiny", **TINY, **extra, loss_chunk_size=6)
    tokens = random.randint(random.key(3), (2, 13), 0, TINY["vocab_size"])
    targets = tokens[:, 1:].clone()
    targets[1, :5] = -100
    batch = {"inputs": tokens[:, :-1], "targets": targets}
    params = plain.init(random.key(0))
    results = []
    for model in (plain, chunked):
        step = train_step(lm_loss(model, z_loss=1e-4), microbatches=2)
        step = jit(step, backend=backend) if backend != "eager" else step
        new, metrics = step(TrainState.create(params=params, tx=optim.sgd(1.0)), batch)
        results.append((metrics, new.params))
    (m0, p0), (m1, p1) = results
    for k in ("loss", "tokens", "grad_norm"):
        torch.testing.assert_close(m1[k], m0[k], rtol=1e-5, atol=1e-5, msg=k)
    for (path, a), (_, b) in zip(tree_leaves_with_path(p0), tree_leaves_with_path(p1)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=path)
    ev0, ev1 = eval_step(lm_loss(plain))(params, batch), eval_step(lm_loss(chunked))(params, batch)
    torch.testing.assert_close(ev1["loss"], ev0["loss"], rtol=1e-5, atol=1e-6)


def test_negative_chunk_size_in_config_is_refused():
    with pytest.raises(ValueError, match=r"Llama3Config.loss_chunk_size must be >= 0 \(0 turns it off\), got -1"):
        build_model("llama3", "tiny", loss_chunk_size=-1)
