"""ember.optim aliases match torch.optim over 100 steps of a small MLP regression (fp32, eager).

Tolerance: max |param difference| < 1e-6 after 100 steps. ember keeps hyperparameters as float32
tensors (so they can change without recompiling) while torch.optim computes with Python doubles:
b2 = 0.999 in float32 moves `1 - b2` by 1.3e-5 relative, a systematic drift in Adam's second
moment of a few 1e-8 per step at lr = 1e-2. The Adam-family cases use lr = 2**-9 (about 2e-3),
where that drift stays near 5e-7 after 100 steps; `lr * weight_decay = 2**-12` makes torch's
decay factor `1 - lr * wd` exact in float32 (otherwise torch itself rounds it every step).
"""

from __future__ import annotations

import pytest
import torch
from optim_testlib import max_abs_diff, mlp_grad, mlp_loss, mlp_params, run_steps

from ember import optim
from ember.core import pytree

LR = 2.0**-9
WD = 0.125
STEPS = 100
TOL = 1e-6


def _decay_groups(named, wd):
    """torch's way of writing `mask=decay_mask`: two param groups."""
    return [
        {"params": [p for p in named.values() if p.ndim >= 2], "weight_decay": wd},
        {"params": [p for p in named.values() if p.ndim < 2], "weight_decay": 0.0},
    ]


TORCH_PARITY_CASES = [  # (id, ember transformation factory, torch.optim factory over named params)
    (
        "adamw",
        lambda: optim.adamw(LR, weight_decay=WD),
        lambda named: torch.optim.AdamW(named.values(), lr=LR, weight_decay=WD),
    ),
    (
        "adam",
        lambda: optim.adam(LR),
        lambda named: torch.optim.Adam(named.values(), lr=LR),
    ),
    (
        "adamw_decay_mask",
        lambda: optim.adamw(LR, weight_decay=WD, mask=optim.decay_mask),
        lambda named: torch.optim.AdamW(_decay_groups(named, WD), lr=LR),
    ),
    (
        "sgd",
        lambda: optim.sgd(0.1),
        lambda named: torch.optim.SGD(named.values(), lr=0.1),
    ),
    (
        "sgd_momentum",
        lambda: optim.sgd(0.05, momentum=0.9),
        lambda named: torch.optim.SGD(named.values(), lr=0.05, momentum=0.9),
    ),
    (
        "sgd_nesterov_weight_decay",
        lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda named: torch.optim.SGD(
            named.values(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
        ),
    ),
]


def run_torch(make_opt, steps):
    """Train `mlp_params()` with a torch.optim optimizer; return the params as a plain tree."""
    init = mlp_params()
    named = {
        f"{layer}.{name}": torch.nn.Parameter(t.clone())
        for layer, sub in init.items()
        for name, t in sub.items()
    }

    def tree():
        return {
            layer: {name: named[f"{layer}.{name}"] for name in sub} for layer, sub in init.items()
        }

    opt = make_opt(named)
    for _ in range(steps):
        opt.zero_grad()
        mlp_loss(tree()).backward()
        opt.step()
    return pytree.tree_map(lambda t: t.detach().clone(), tree())


@pytest.mark.parametrize(
    "ember_tx,torch_opt",
    [c[1:] for c in TORCH_PARITY_CASES],
    ids=[c[0] for c in TORCH_PARITY_CASES],
)
def test_matches_torch_optim(ember_tx, torch_opt):
    ours, _ = run_steps(ember_tx(), mlp_params(), mlp_grad, STEPS)
    ref = run_torch(torch_opt, STEPS)
    assert max_abs_diff(ours, ref) < TOL
    # The run actually trained (a parity test of two frozen models would prove nothing).
    assert float(mlp_loss(ours)) < 0.9 * float(mlp_loss(mlp_params()))
