"""`shared_call`: repeated calls trace and compile one body in ember's Inductor step, and stay exact."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ember.core import jit
from ember.core.compat import measured_here
from ember.core.shared_call import shared_call
from ember.core.transforms import remat, value_and_grad


def _counting(fn):
    def counted(*args):
        counted.calls += 1
        return fn(*args)

    counted.calls = 0
    return counted


def _mlp(p, x):
    return {"h": torch.tanh(x @ p["w"]), "n": None}


def test_nested_compile_region_still_inlines_under_make_fx():
    """When torch's public marker emits its subgraph under make_fx, drop the `shared_subgraph` patch for it."""
    if not measured_here("shared_subgraph"):
        pytest.skip("not measured on this torch: the tests below check the shared bodies")
    region = torch.compiler.nested_compile_region(lambda x: torch.sin(x) * 2)
    gm = make_fx(lambda x: region(region(x)), tracing_mode="fake")(torch.ones(3))
    assert not any("invoke_subgraph" in str(n.target) for n in gm.graph.nodes)


def test_repeated_calls_trace_one_body_and_match_eager():
    body = _counting(_mlp)

    def run(p, xs):
        return [shared_call(body, "test.mlp", p, x)["h"] for x in xs] + [shared_call(body, "test.mlp", p, xs[0][:1])["h"]]

    p = {"w": torch.randn(4, 4)}
    xs = [torch.randn(2, 4) for _ in range(5)]
    want = run(p, xs)
    assert body.calls == 6  # eagerly: a plain call each time
    body.calls = 0
    got = jit(run)(p, xs)
    assert body.calls == 2  # compiled: one trace per signature (five (2, 4) calls, one (1, 4))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))  # Inductor's tanh vs eager's


def test_functions_sharing_a_name_do_not_share_a_body():
    def run(x):
        a = shared_call(lambda t: t + 1, "test.same", x)
        return a, shared_call(lambda t: t * 3, "test.same", x)

    got = jit(run)(torch.ones(2))
    assert got[0].tolist() == [2.0, 2.0] and got[1].tolist() == [3.0, 3.0]


def test_constants_key_the_body_and_objects_fall_back_to_a_plain_call():
    body = _counting(lambda x, scale, fn: fn(x) * scale)

    def run(x):
        return (shared_call(body, "test.c", x, 2.0, torch.sin), shared_call(body, "test.c", x, 3.0, torch.sin),
                shared_call(body, "test.c", x, 3.0, torch.cos))

    x = torch.rand(3)
    got = jit(run)(x)
    want = (torch.sin(x) * 2, torch.sin(x) * 3, torch.cos(x) * 3)
    assert all(torch.allclose(a, b) for a, b in zip(got, want))
    assert body.calls == 3  # a function argument cannot key a body: each call runs plainly


def test_a_body_that_takes_gradients_gets_them_in_the_compiled_step():
    # torch's op traces a body below autograd: without the caller's dispatch keys inside it, every
    # gradient the body took came back zero, silently.
    def per_batch(w, x):
        return value_and_grad(lambda w: (torch.tanh(x @ w) ** 2).sum())(w)

    def summed(w, xs):
        values, grads = zip(*(shared_call(per_batch, "test.per_batch", w, xs[i]) for i in range(3)))
        return sum(values), sum(grads)

    w, xs = torch.randn(4, 4), torch.randn(3, 2, 4)
    value, grads = jit(summed)(w, xs)
    want_value, want_grads = summed(w, xs)
    assert grads.abs().sum() > 0
    torch.testing.assert_close(grads, want_grads, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(value, want_value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["none", "full", "dots_saveable"])
def test_shared_remat_traces_one_layer_and_gives_the_plain_gradient(policy):
    traced = []

    def layer(p, x):
        traced.append(1)
        return torch.tanh(x @ p["w"]) + x

    shared = remat(layer, policy=policy, shared=True)

    def loss(params, x, f):
        x = x @ params["embed"]  # so that every layer's input needs a gradient: one backward body
        for p in params["layers"]:
            x = f(p, x)
        return (x ** 2).sum()

    torch.manual_seed(0)  # fixed inputs: an unlucky draw put one gradient element past the float32 tolerance
    params = {"embed": torch.randn(4, 4), "layers": [{"w": torch.randn(4, 4) / 2} for _ in range(6)]}
    x = torch.randn(3, 4)
    want = value_and_grad(loss)(params, x, layer)
    traced.clear()
    got = jit(lambda params, x: value_and_grad(loss)(params, x, shared))(params, x)
    assert len(traced) == 2  # six layers: one forward body, one backward body (which re-runs the layer)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # compiled vs eager float32
