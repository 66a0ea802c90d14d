"""ember's `grad` takes gradients with `torch.autograd.grad` inside the call: pure from the outside, exact,
and able to differentiate what `torch.func.grad` cannot (saved-tensor hooks: `torch.utils.checkpoint`)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from ember.core.jit import jit
from ember.core.transforms import grad, value_and_grad, vmap


def _loss(p, x):
    return torch.tanh(x @ p["w"]).square().mean() + p["b"].sum() * 0.0


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}, torch.randn(5, 3, generator=g)


def test_the_gradient_equals_torch_func_and_touches_nothing_outside():
    p, x = _params()
    before = {k: v.clone() for k, v in p.items()}
    (value, aux), g = value_and_grad(lambda p, x: (_loss(p, x), {"x": x.sum()}), has_aux=True)(p, x)
    want = torch.func.grad(_loss)(p, x)
    for k in p:
        torch.testing.assert_close(g[k], want[k], rtol=0, atol=0)
        assert torch.equal(p[k], before[k]) and not p[k].requires_grad and p[k].grad is None
    assert not value.requires_grad and not aux["x"].requires_grad and not g["w"].requires_grad
    assert torch.equal(g["b"], torch.zeros(4))  # unused leaf: zeros, as torch.func gives


def test_a_constant_loss_gets_zero_gradients():
    p, _ = _params()
    g = grad(lambda p: torch.tensor(1.0))(p)
    assert all(torch.equal(v, torch.zeros_like(p[k])) for k, v in g.items())


def test_grad_of_grad_and_grad_inside_vmap_are_exact():
    f = lambda x: (x**3).sum()  # noqa: E731
    x = torch.tensor([1.0, 2.0])
    second = grad(lambda x: grad(f)(x).sum())(x)
    torch.testing.assert_close(second, 6 * x)
    per_row = vmap(grad(f))(torch.stack([x, 2 * x]))  # torch.func where vmap is active
    torch.testing.assert_close(per_row, 3 * torch.stack([x, 2 * x]) ** 2)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_checkpoint_differentiates_eager_and_compiled(backend):
    p, x = _params()

    def checkpointed(p, x):
        return checkpoint(_loss, p, x, use_reentrant=False)

    got = jit(value_and_grad(checkpointed), backend=backend)(p, x)
    want = value_and_grad(_loss)(p, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_an_argument_already_requiring_grad_stays_differentiable_by_outer_autograd():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    g = grad(lambda w: (w**2).sum())(w)  # 2w, recorded for the outer backward
    (g.sum()).backward()
    torch.testing.assert_close(w.grad, torch.tensor([2.0, 2.0]))


def test_detached_vjp_equals_torch_func_vjp_on_both_engines():
    from ember.core.autograd_grad import detached_vjp

    p, x = _params()
    p = {**p, "steps": torch.tensor(3)}  # an integer leaf: passed through, no gradient
    x = x.requires_grad_(True)  # history cut off: nothing reaches x's own graph
    head = lambda p, x: torch.tanh(x @ p["w"]) + p["b"] * p["steps"]  # noqa: E731
    cotangent = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    floats = {k: p[k] for k in ("w", "b")}
    want_out, want_pull = torch.func.vjp(lambda f, r: head({**f, "steps": p["steps"]}, r), floats, x.detach())
    want = want_pull(cotangent)
    out, pull = detached_vjp(head, p, x)  # torch.autograd.grad
    assert not out.requires_grad and torch.equal(out, want_out)
    got = pull(cotangent)
    assert torch.equal(got[0]["steps"], p["steps"]) and x.grad is None
    for g, w in ((got[0]["w"], want[0]["w"]), (got[0]["b"], want[0]["b"]), (got[1], want[1])):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # Inside a torch.func transform the same call goes through torch.func.vjp and composes with it.
    with_steps = lambda f, r: head({**f, "steps": p["steps"]}, r)  # noqa: E731
    per_row = vmap(lambda r: detached_vjp(with_steps, floats, r)[1](cotangent[0])[1])(x.detach())
    rows = [torch.func.vjp(lambda r: with_steps(floats, r), x[i].detach())[1](cotangent[0])[0] for i in range(5)]
    torch.testing.assert_close(per_row, torch.stack(rows))
