"""Ready-made optimizers: `chain`s of building blocks, with tensor hyperparameters.

Public names: `adam`, `adamw`, `sgd`, `lion` (`adafactor` is in `adafactor.py`, beside its statistics).

Each alias only chains building blocks (no math of its own) and wraps the chain in
`inject_hyperparams`, so its state holds an `InjectHyperparamsState` whose `hyperparams` dict has
a 0-d float32 tensor per numeric argument (`"learning_rate"`, `"b1"`, `"weight_decay"`, ...).
`set_hyperparams(opt_state, learning_rate=...)` changes one without recompiling a compiled
step, and a schedule passed as `learning_rate` is evaluated at the step count inside `update`
(its current value is in `hyperparams["learning_rate"]`).
"""

from __future__ import annotations

from typing import Optional

from .adam import scale_by_adam
from .base import GradientTransformation, Scalar, ScalarOrSchedule
from .combining import chain
from .hyperparams import inject_hyperparams
from .lion import scale_by_lion
from .masking import Mask
from .momentum import trace
from .scaling import scale_by_learning_rate
from .weight_decay import add_decayed_weights

__all__ = ["adam", "adamw", "lion", "sgd"]


def _is_zero(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def _adam_chain(
    learning_rate: Scalar, b1: Scalar, b2: Scalar, eps: Scalar
) -> GradientTransformation:
    return chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate))


def adam(
    learning_rate: ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> GradientTransformation:
    r"""Adam (Kingma & Ba, 2015), matching `torch.optim.Adam` and `optax.adam`.

    With gradient `g_t`, step `t = 1, 2, ...` and learning rate `lr_t`:

        m_t = b1 * m_{t-1} + (1 - b1) * g_t
        v_t = b2 * v_{t-1} + (1 - b2) * g_t ** 2
        m_hat = m_t / (1 - b1 ** t),   v_hat = v_t / (1 - b2 ** t)
        update = -lr_t * m_hat / (sqrt(v_hat) + eps)

    Built as `chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate))`.

    Args:
        learning_rate: a number, a 0-d tensor, or a schedule `count -> 0-d tensor`.
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.

    Returns:
        A `GradientTransformation` with an `InjectHyperparamsState` (hyperparameters
        `learning_rate, b1, b2, eps`).

    Example:
        >>> import torch
        >>> from ember import optim
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> tx = optim.adam(0.1)
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     grads = {"w": 2 * params["w"]}  # d/dw of sum(w ** 2)
        ...     updates, state = tx.update(grads, state, params)
        ...     params = optim.apply_updates(params, updates)
        >>> [round(v, 4) for v in params["w"].tolist()]  # about lr per step along sign(g)
        [0.7016, -1.7006]

    References:
        Kingma & Ba, Adam: A Method for Stochastic Optimization, ICLR 2015
        (https://arxiv.org/abs/1412.6980).
    """
    return inject_hyperparams(_adam_chain)(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)


def _adamw_chain(
    learning_rate: Scalar,
    b1: Scalar,
    b2: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    mask: Optional[Mask],
) -> GradientTransformation:
    return chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay, mask=mask),
        scale_by_learning_rate(learning_rate),
    )


def adamw(
    learning_rate: ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    r"""AdamW: Adam with decoupled weight decay, matching `torch.optim.AdamW` and `optax.adamw`.

    With `m_hat`, `v_hat` as in `adam` and `lambda = weight_decay`:

        update = -lr_t * (m_hat / (sqrt(v_hat) + eps) + lambda * param)

    which is torch's `param *= 1 - lr * lambda` followed by the Adam step. `mask` limits the
    decay to some parameters (`mask=optim.decay_mask` skips norms and biases, as nanoGPT).
    Built as `chain(scale_by_adam, add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate)`.

    Args:
        learning_rate: a number, a 0-d tensor, or a schedule `count -> 0-d tensor`.
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.
        weight_decay: decoupled weight decay rate.
        mask: which parameters to decay: a pytree of bools matching params, or a function
            `params -> bools` such as `decay_mask`; `None` decays all.

    Returns:
        A `GradientTransformation` with an `InjectHyperparamsState` (hyperparameters
        `learning_rate, b1, b2, eps, weight_decay`).

    Example:
        >>> import torch
        >>> from ember import optim
        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> tx = optim.adamw(optim.linear_schedule(0.0, 0.1, 10), weight_decay=0.1,
        ...                  mask=optim.decay_mask)
        >>> state = tx.init(params)
        >>> grads = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> for _ in range(3):
        ...     updates, state = tx.update(grads, state, params)
        ...     params = optim.apply_updates(params, updates)
        >>> round(params["w"][0, 0].item(), 6), params["b"][0].item()  # only w decays
        (0.997002, 1.0)
        >>> round(optim.get_hyperparams(state)["learning_rate"].item(), 4)  # lr of the last step
        0.02

    References:
        Loshchilov & Hutter, Decoupled Weight Decay Regularization, ICLR 2019
        (https://arxiv.org/abs/1711.05101).
    """
    return inject_hyperparams(_adamw_chain, static_args="mask")(
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask
    )


def _sgd_chain(
    learning_rate: Scalar,
    momentum: Optional[Scalar],
    nesterov: bool,
    weight_decay: Optional[Scalar],
) -> GradientTransformation:
    txs = []
    if weight_decay is not None:
        txs.append(add_decayed_weights(weight_decay))
    if momentum is not None:
        txs.append(trace(momentum, nesterov))
    txs.append(scale_by_learning_rate(learning_rate))
    return chain(*txs)


def sgd(
    learning_rate: ScalarOrSchedule,
    *,
    momentum: Optional[float] = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    r"""Stochastic gradient descent with optional momentum, matching `torch.optim.SGD`.

    With `mu = momentum` and `lambda = weight_decay` (an L2 term added to the gradient):

        g'_t = g_t + lambda * param
        b_t  = mu * b_{t-1} + g'_t                      (b_0 = 0, so b_1 = g'_1)
        update = -lr_t * b_t                            (or -lr_t * (g'_t + mu * b_t), Nesterov)

    Built as `chain(add_decayed_weights(weight_decay), trace(momentum, nesterov),
    scale_by_learning_rate(learning_rate))`; a zero `weight_decay` or `momentum=None` leaves
    that block out (and out of the hyperparameters).

    Args:
        learning_rate: a number, a 0-d tensor, or a schedule `count -> 0-d tensor`.
        momentum: the momentum coefficient, or None for plain SGD.
        nesterov: Nesterov momentum (needs `momentum`).
        weight_decay: L2 penalty coefficient (coupled, as in torch.optim.SGD).

    Returns:
        A `GradientTransformation` with an `InjectHyperparamsState`.

    Raises:
        ValueError: `nesterov=True` without a momentum.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> params = {"w": torch.tensor([1.0])}
        >>> tx = optim.sgd(0.1, momentum=0.9)
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     updates, state = tx.update({"w": torch.tensor([1.0])}, state, params)
        ...     params = optim.apply_updates(params, updates)
        >>> round(params["w"].item(), 4)  # 1 - 0.1 * 1 - 0.1 * 1.9
        0.71

    References:
        Polyak, Some methods of speeding up the convergence of iteration methods, 1964
        (heavy-ball momentum); Sutskever et al., On the importance of initialization and
        momentum in deep learning, ICML 2013 (the Nesterov form).
    """
    if nesterov and (momentum is None or _is_zero(momentum)):
        raise ValueError(
            "sgd(nesterov=True) needs a momentum, got momentum="
            f"{momentum!r}. Pass e.g. momentum=0.9, or nesterov=False."
        )
    return inject_hyperparams(_sgd_chain)(
        learning_rate=learning_rate,
        momentum=None if _is_zero(momentum) else momentum,
        nesterov=nesterov,
        weight_decay=None if _is_zero(weight_decay) else weight_decay,
    )


def _lion_chain(
    learning_rate: Scalar, b1: Scalar, b2: Scalar, weight_decay: Scalar, mask: Optional[Mask]
) -> GradientTransformation:
    return chain(
        scale_by_lion(b1, b2),
        add_decayed_weights(weight_decay, mask=mask),
        scale_by_learning_rate(learning_rate),
    )


def lion(
    learning_rate: ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-3,
    mask: Optional[Mask] = None,
) -> GradientTransformation:
    r"""Lion (EvoLved Sign Momentum, Chen et al. 2023), matching `optax.lion`.

        c_t = sign((1 - b1) * g_t + b1 * m_{t-1})
        m_t = b2 * m_{t-1} + (1 - b2) * g_t
        update = -lr_t * (c_t + weight_decay * param)

    Every coordinate moves by exactly `lr` (before decay), so Lion wants a learning rate 3-10x
    smaller than AdamW's and a weight decay 3-10x larger. Built as `chain(scale_by_lion(b1, b2),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))`.

    Args:
        learning_rate: a number, a 0-d tensor, or a schedule `count -> 0-d tensor`.
        b1: interpolation weight of the momentum in the update direction.
        b2: decay of the momentum.
        weight_decay: decoupled weight decay rate.
        mask: which parameters to decay (as in `adamw`).

    Returns:
        A `GradientTransformation` with an `InjectHyperparamsState`.

    Example:
        >>> import torch
        >>> from ember import optim
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> tx = optim.lion(0.1, weight_decay=0.0)
        >>> updates, _ = tx.update({"w": torch.tensor([0.5, -3.0])}, tx.init(params), params)
        >>> updates["w"].tolist()
        [-0.10000000149011612, 0.10000000149011612]

    References:
        Chen et al., Symbolic Discovery of Optimization Algorithms, 2023
        (https://arxiv.org/abs/2302.06675).
    """
    return inject_hyperparams(_lion_chain, static_args="mask")(
        learning_rate=learning_rate, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask
    )
