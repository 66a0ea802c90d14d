"""`pipeline`: a stack of layers scheduled as stages equals the layers run one after another, in value and
gradient, on one device, compiled, and over `pp=2` on DTensor (gloo, `_pipeline_worker.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ember.core.partition_specs.pipeline import PipelineError, bubble_fraction, pipeline

D = 6


def layer(p, h):
    return h + torch.tanh(h @ p["w"] + p["b"])


def stack(n_layers: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n_layers, D, D, generator=g, dtype=torch.float64) / D ** 0.5,
            "b": torch.randn(n_layers, D, generator=g, dtype=torch.float64)}


def sequential(params, x):
    for j in range(params["w"].shape[0]):
        x = layer({"w": params["w"][j], "b": params["b"][j]}, x)
    return x


def loss_and_grads(fn, params, x):
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    x = x.detach().requires_grad_()
    loss = fn(params, x).square().mean()
    return (loss.detach(), *torch.autograd.grad(loss, [params["w"], params["b"], x]))


@pytest.mark.parametrize("layers,stages,microbatches,repeats", [(4, 2, 2, 1), (4, 2, 4, 1), (6, 3, 5, 1),
                                                                (8, 2, 4, 2), (6, 2, 3, 3), (4, 1, 1, 1)])
def test_pipeline_equals_the_layers_in_order_with_their_gradients(layers, stages, microbatches, repeats):
    params, x = stack(layers), torch.randn(2 * microbatches, 3, D, dtype=torch.float64)
    got = loss_and_grads(lambda p, h: pipeline(layer, p, h, stages=stages, microbatches=microbatches,
                                               repeats=repeats), params, x)
    for a, b in zip(got, loss_and_grads(sequential, params, x)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def counting_layer(p, carry):  # adds to totals beside the activations, as a mixture of experts' router stats
    h, totals = carry
    h = layer(p, h)
    return h, {"sum": totals["sum"] + h.sum(0), "peak": torch.maximum(totals["peak"], h.abs().max().detach())}


def merge_totals(a, b):
    return {"sum": a["sum"] + b["sum"], "peak": torch.maximum(a["peak"], b["peak"])}


@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 4, 1), (2, 2, 2)])
def test_totals_ride_through_the_stages_and_add_up_over_microbatches(stages, microbatches, repeats):
    g = torch.Generator().manual_seed(2)
    params, x = stack(4), torch.randn(8, D, dtype=torch.float64, generator=g)
    given = {"sum": torch.randn(D, dtype=torch.float64, generator=g), "peak": torch.tensor(0.5, dtype=torch.float64)}

    def plain(p, h):
        carry = (h, given)
        for j in range(4):
            carry = counting_layer({k: v[j] for k, v in p.items()}, carry)
        return carry

    def piped(p, h):
        return pipeline(counting_layer, p, h, stages=stages, microbatches=microbatches, repeats=repeats,
                        totals=given, merge=merge_totals)

    def loss(fn, p, h):
        y, totals = fn(p, h)
        return y.square().mean() + totals["sum"].square().sum(), totals["peak"]

    got, want = loss_and_grads(lambda p, h: loss(piped, p, h)[0], params, x), loss_and_grads(
        lambda p, h: loss(plain, p, h)[0], params, x)
    for a, b in zip(got, want):  # the sums over microbatches are taken in another order
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert loss(piped, params, x)[1] == loss(plain, params, x)[1]  # the largest over every microbatch and layer
    with pytest.raises(PipelineError, match="takes totals and merge together"):
        pipeline(counting_layer, params, x, stages=2, microbatches=4, totals=given)


def test_a_nan_in_a_bubble_slot_reaches_no_gradient():
    from ember.core.partition_specs.pipeline import _schedule
    from ember.core.partition_specs.pipeline_stages import Stages

    S, M = 2, 4

    class NaNInTheBubble(Stages):  # after each shift, NaN in every slot whose stage idles next
        i = 0

        def shift(self, out):
            buffer = super().shift(out)
            self.i += 1
            idle = torch.tensor([s > 0 and not 0 <= self.i - s < M for s in range(S)])
            return torch.where(idle.view(-1, 1, 1), torch.full_like(buffer, float("nan")), buffer)

    params, x = stack(4), torch.randn(M, D, dtype=torch.float64)
    staged = lambda p: {k: t.reshape(1, S, 2, *t.shape[1:]) for k, t in p.items()}  # noqa: E731
    loss, *grads = loss_and_grads(lambda p, h: _schedule(layer, staged(p), h, NaNInTheBubble(S), S, M, 1)[0],
                                  params, x)
    assert all(torch.isfinite(g).all() for g in grads)
    for a, b in zip((loss, *grads), loss_and_grads(sequential, params, x)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_pipeline_compiled_equals_eager():
    params, x = stack(4), torch.randn(8, D, dtype=torch.float64)

    def fn(p, h):
        return pipeline(layer, p, h, stages=2, microbatches=4)

    eager = loss_and_grads(fn, params, x)
    compiled = loss_and_grads(torch.compile(fn, backend="inductor", fullgraph=True), params, x)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("microbatches", [4, 8])
def test_the_schedule_is_one_loop_each_way_in_embers_compiled_step(microbatches):
    """The iterations roll (`remat_scan`): the step's graph holds one forward and one backward loop whatever
    the microbatches, so its compile does not grow with them (BENCHMARKS.md: 16 vs 4 microbatches)."""
    from _graphs import scan_nodes  # here: the DTensor workers import this module from tests/core alone

    from ember.core import jit, value_and_grad

    params, x = stack(4), torch.randn(2 * microbatches, D, dtype=torch.float64)

    def loss(p, h):
        return pipeline(layer, p, h, stages=2, microbatches=microbatches).square().mean()

    assert scan_nodes(value_and_grad(loss), params, x) == 2
    value, grads = jit(value_and_grad(loss), backend="inductor")(params, x)
    want, w, b, _ = loss_and_grads(sequential, params, x)
    for a, b in zip((value, grads["w"], grads["b"]), (want, w, b)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_bubble_fraction_is_gpipes():
    assert bubble_fraction(4, 8) == 3 / 11 and bubble_fraction(2, 4, repeats=2) == 1 / 9 and bubble_fraction(1, 3) == 0


@pytest.mark.parametrize("layers,stages,microbatches,repeats,batch,says", [
    (5, 2, 2, 1, 4, "5 layers do not split into 2 stages x 1 repeats"),
    (8, 2, 4, 3, 4, r"multiple of stages x repeats \(6\)"),
    (4, 4, 2, 1, 4, "2 microbatches are fewer than the 4 stages"),
    (4, 2, 3, 1, 4, "a batch of 4 does not split into 3 microbatches"),
    (4, 0, 3, 1, 4, "stages must be an int >= 1"),
])
def test_bad_schedules_are_refused_in_one_line_with_the_fix(layers, stages, microbatches, repeats, batch, says):
    with pytest.raises(PipelineError, match=says) as err:
        pipeline(layer, stack(layers), torch.randn(batch, D, dtype=torch.float64), stages=stages,
                 microbatches=microbatches, repeats=repeats)
    assert "\n" not in str(err.value)


def test_the_sharding_report_shows_stages_layers_and_the_bubble():
    from ember.core.mesh import Mesh
    from ember.core.partition_specs.report import describe_sharding

    axes = {"blocks": {"w": ("layers", "embed", "mlp")}, "wte": ("vocab", "embed")}
    params = {"blocks": {"w": torch.empty(8, 4, 4, device="meta")}, "wte": torch.empty(16, 4, device="meta")}
    report = describe_sharding(params, Mesh.parse("pp=4", backend="xla"), axes=axes)
    assert "pipeline: 4 stages of 2 layers (of 8), 4 microbatches x 1 repeat(s), bubble 42.9%" in report
    assert "pipeline" not in describe_sharding(params, Mesh.parse("dp=4", backend="xla"), axes=axes)


def test_a_rule_sharding_two_dimensions_over_pp_is_refused_with_the_fix():
    from ember.core.partition_specs import ShardingRuleError
    from ember.core.partition_specs.rules import Rules, resolve

    with pytest.raises(ShardingRuleError, match="would use mesh axis 'pp' twice in one tensor.*add a fallback"):
        resolve(("layers", "embed"), Rules([("layers", "pp"), ("embed", "pp")]), mesh_sizes={"pp": 2}, name="w")


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_pipeline_worker.py")
    proc = subprocess.run([sys.executable, worker, "--out", str(out)], capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("case", ["eager", "compiled", "eager, two stages a process"])
def test_pipeline_over_pp2_on_dtensor_equals_one_device(gloo_run, case):
    res = gloo_run[case]
    assert "error" not in res, res.get("error")
    params, x = stack(4), torch.randn(8, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = loss_and_grads(sequential, params, x)
    assert res["local_w"] == [2, D, D]  # each process holds its stage's two layers
    for got, want in zip(res["loss_and_grads"], ref):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-12)
    stages = 4 if "two stages" in case else 2
    assert res["all_gathers"] == 0 and res["all_to_alls"] == 2 * (4 + stages - 1)  # a shift each way an iteration
