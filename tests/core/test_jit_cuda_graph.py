"""jit(cuda_graph=True): refused clearly where it cannot run; the written inputs are found in the traced
graph; on a GPU a captured donated step gives the losses of the uncaptured one (gpu-marked)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ember.core import TrainState, jit, random
from ember.core.jit_backends.cuda_graph import CudaGraphed, mutated_inputs
from ember.core.jit_backends.donation import make_entry
from ember.core.pytree import tree_leaves, tree_map
from ember.core.step_fns import train_step
from ember.optim import adamw


def _double(x):
    return 2 * x


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refused_without_a_gpu():
    with pytest.raises(ValueError, match=r"cuda_graph=True\).*torch.cuda.is_available\(\) is False.*drop"):
        jit(_double, cuda_graph=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="eager"), r"backend='eager' compiles no graph.*backend='inductor'"),
    (dict(backend="xla"), r"backend='xla' compiles no graph"),
    (dict(mode="reduce-overhead"), r"reduce-overhead.*pass only one"),
])
def test_refused_with_arguments_it_cannot_honour(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jit(_double, cuda_graph=True, **kwargs)
    with pytest.raises(TypeError, match=r"cuda_graph=\.\.\.\) takes True or False"):
        jit(_double, cuda_graph="yes")


def _sgd_step(state, batch):
    new = {"w": state["w"] - 0.1 * batch, "key": state["key"]}
    return new, {"loss": (new["w"] ** 2).sum()}


def test_mutated_inputs_are_the_donated_leaves_it_rewrites():
    state = {"w": torch.ones(3), "key": torch.zeros(2, dtype=torch.int64)}
    flat = lambda w, key, x: tree_leaves(make_entry(_sgd_step, "state")({"w": w, "key": key}, x)[0])  # noqa: E731
    gm = make_fx(flat)(state["w"], state["key"], torch.ones(3))
    assert mutated_inputs(gm) == frozenset({0})  # the key, returned as it came, is not copied: read only
    assert mutated_inputs(make_fx(lambda w, x: (w + x,))(torch.ones(3), torch.ones(3))) == frozenset()
    through_view = make_fx(lambda w, x: w.view(3, 1).mul_(2).sum() + x)(torch.ones(3), torch.ones(()))
    assert mutated_inputs(through_view) == frozenset({0})


class _ReplayedOnCpu(CudaGraphed):
    """CudaGraphed with a stand-in for the CUDA graph, as a graph behaves: each replay reads the captured
    inputs, writes the written ones in place and its results into the same output tensors."""

    _check_devices = staticmethod(lambda inputs: None)

    def _record(self, static_inputs):
        shapes = self._compiled(*[t.clone() for t in static_inputs])  # a capture runs nothing

        class Graph:
            def replay(graph):
                for out, new in zip(outputs, self._compiled(*static_inputs)):
                    out.copy_(new)

        outputs = tuple(torch.full_like(t, float("nan")) for t in shapes)
        return Graph(), outputs


def test_replays_donate_in_place_read_private_copies_and_return_copies():
    def flat(w, key, x):
        (new, metrics), _ = make_entry(_sgd_step, "state")({"w": w, "key": key}, x)
        return (metrics["loss"],)

    state = {"w": torch.ones(3), "key": torch.zeros(2, dtype=torch.int64)}
    gm = make_fx(flat)(*[t.clone() for t in state.values()], torch.ones(3))
    graphed = _ReplayedOnCpu(gm, mutated_inputs(gm))
    batches = [torch.full((3,), float(i)) for i in range(1, 5)]
    losses = [graphed(state["w"], state["key"], x)[0] for x in batches[:3]]  # run, capture + replay, replay
    assert graphed.captured and [float(x) for x in losses] == pytest.approx([2.43, 1.47, 0.48])  # w 0.9, 0.7, 0.4
    assert [float(x[0]) for x in batches] == [1.0, 2.0, 3.0, 4.0]  # the caller's batches are only read
    moved = state["w"].clone()  # a state in other tensors: copied in, and the result back out
    assert float(graphed(moved, state["key"], batches[3])[0]) == pytest.approx(0.0, abs=1e-6)
    assert float(moved[0]) == pytest.approx(0.0, abs=1e-6) and float(state["w"][0]) == pytest.approx(0.0, abs=1e-6)
    assert float(losses[1]) == pytest.approx(1.47)  # an earlier call's outputs are copies, never overwritten


@pytest.mark.gpu
def test_captured_donated_step_gives_the_same_losses():
    def loss_fn(params, batch, *, key):
        return ((batch["x"] @ params["w"] - batch["y"]) ** 2).mean()

    def fresh_state():
        params = {"w": torch.linspace(-1.0, 1.0, 24, device="cuda").reshape(8, 3)}
        return TrainState.create(params=params, tx=adamw(1e-2), key=random.key(0, device="cuda"))

    gen = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(4, 8, generator=gen).cuda(), "y": torch.randn(4, 3, generator=gen).cuda()}
               for _ in range(3)]
    originals = tree_map(torch.clone, batches)
    plain = jit(train_step(loss_fn), donate="state")
    graphed = jit(train_step(loss_fn), donate="state", cuda_graph=True)
    ref_state, state = fresh_state(), fresh_state()
    pointers = [t.data_ptr() for t in tree_leaves(state)]
    ref, got = [], []
    for batch in batches:
        ref_state, m = plain(ref_state, batch)
        ref.append(m)
        state, m = graphed(state, batch)
        got.append(m)  # held across steps: a replay must not overwrite an earlier step's metrics
    assert graphed.compile_count == 1
    assert [t.data_ptr() for t in tree_leaves(state)] == pointers  # donated in place, never copied aside
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(batches), tree_leaves(originals)))  # only read
    for r, g in zip(ref, got):
        torch.testing.assert_close(g["loss"], r["loss"], rtol=1e-5, atol=1e-6)
    # a state in other tensors (a restored checkpoint) is copied into the graph and its result back out
    moved = tree_map(torch.clone, state)
    ref_state, r = plain(ref_state, batches[0])
    moved, g = graphed(moved, batches[0])
    torch.testing.assert_close(g["loss"], r["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moved.params["w"], ref_state.params["w"], rtol=1e-5, atol=1e-6)
