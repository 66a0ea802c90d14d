"""Checks on functions: gradients against finite differences, and purity.

Public names: `check_grads`, `assert_pure`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor

from ..pytree import tree_flatten_with_path, tree_map, tree_unflatten
from ._compare import _call_path, _compare_leaf, _index, _to_cpu
from ._trees import assert_trees_all_equal


def check_grads(
    fn: Callable[..., Tensor],
    args: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """Check `torch.func.grad` of a scalar function against central finite differences.

    Every floating tensor leaf of `args` is cast to float64 and differentiated; other leaves are
    passed through. Each element costs two calls of `fn`, so keep the inputs small.

    Args:
        fn: `fn(*args) -> 0-d tensor`, differentiable with `torch.func.grad`.
        args: a tuple of positional arguments (pytrees), or a single tensor / pytree.
        eps: finite-difference step (float64 central differences: error ~ eps**2).
        atol: absolute tolerance between analytic and numeric gradients.
        rtol: relative tolerance (relative to the numeric gradient).

    Raises:
        AssertionError: naming the argument path (`args[0].w`) of the worst element, its index,
            both gradient values and how many elements disagree.
        ValueError: `fn` does not return a 0-d tensor, or `args` has no floating tensor.

    Example:
        >>> import torch
        >>> from ember.core.testing import check_grads
        >>> check_grads(lambda p, x: (torch.tanh(x @ p["w"]) ** 2).sum(),
        ...             ({"w": torch.randn(3, 2)}, torch.randn(4, 3)))
    """
    if not isinstance(args, tuple):
        args = (args,)
    flat, treespec = tree_flatten_with_path((args, {}))
    leaves = [leaf for _, leaf in flat]
    diff_idx = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and x.is_floating_point()]
    if not diff_idx:
        raise ValueError("check_grads: `args` holds no floating tensor to differentiate.")
    differentiated = set(diff_idx)
    base = [
        x.detach().to(torch.float64) if i in differentiated else x for i, x in enumerate(leaves)
    ]

    def call(float_leaves: List[Tensor]) -> Tensor:
        full = list(base)
        for i, v in zip(diff_idx, float_leaves):
            full[i] = v
        a, kw = tree_unflatten(full, treespec)
        out = fn(*a, **kw)
        if not isinstance(out, Tensor) or out.dim() != 0:
            raise ValueError(
                f"check_grads: fn must return a 0-d tensor, got "
                f"{tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__}; "
                f"reduce it (e.g. `.sum()`)."
            )
        return out

    float_leaves = [base[i] for i in diff_idx]
    analytic = torch.func.grad(call)(float_leaves)
    with torch.no_grad():
        for k, i in enumerate(diff_idx):
            x = float_leaves[k]
            numeric = torch.empty_like(x).reshape(-1)
            for j in range(x.numel()):
                values = []
                for sign in (1.0, -1.0):
                    bumped = list(float_leaves)
                    xp = x.clone().reshape(-1)
                    xp[j] += sign * eps
                    bumped[k] = xp.reshape(x.shape)
                    values.append(call(bumped))
                numeric[j] = (values[0] - values[1]) / (2 * eps)
            got = analytic[k].reshape(-1)
            ok = torch.isclose(got, numeric, rtol=rtol, atol=atol)
            if bool(ok.all()):
                continue
            err = (got - numeric).abs().nan_to_num(nan=math.inf)
            worst = int(err.argmax())
            raise AssertionError(
                f"gradient of fn w.r.t. {_call_path(flat[i][0])} does not match finite "
                f"differences at index {_index(worst, tuple(x.shape))}: torch.func.grad gives "
                f"{got[worst].item():.8g}, finite differences {numeric[worst].item():.8g} "
                f"(abs error {err[worst].item():.3g}; {int((~ok).sum())} of {ok.numel()} elements "
                f"differ with rtol={rtol:g}, atol={atol:g}, eps={eps:g})"
            )


def _tensor_snapshot(args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    flat, _ = tree_flatten_with_path((args, kwargs))
    return [
        (path, leaf, leaf.detach().clone(), getattr(leaf, "_version", None))
        for path, leaf in flat
        if isinstance(leaf, Tensor)
    ]


_DONATION_HINT = (
    "\nIf the step donates its state on purpose (`jit(..., donate=\"state\")`), pass that jitted "
    "function itself (or one wrapping it with functools.wraps / functools.partial): assert_pure "
    "then gives it a fresh copy of the state on each call."
)


def _check_untouched(snapshot, call: str) -> None:
    for path, leaf, copy, version in snapshot:
        changed_version = version is not None and getattr(leaf, "_version", None) != version
        msg = _compare_leaf(leaf, copy, rtol=0.0, atol=0.0, exact=True)
        if msg is not None or changed_version:
            detail = msg if msg is not None else "  (same values, but written in place)"
            where = _call_path(path)
            raise AssertionError(
                f"step modified its input {where} in place during the {call} call; a "
                f"pure step must return new tensors (use out-of-place ops, e.g. `x + y` rather "
                f"than `x.add_(y)`):\n{detail}" + (_DONATION_HINT if where.startswith("args[0]") else "")
            )


def _donates_state(step: Any) -> bool:
    """Whether `step` is a `jit(..., donate="state")` function, or wraps one (functools.wraps/partial)."""
    from ..jit import Jitted

    for _ in range(16):  # a chain of wrappers, never a cycle
        if isinstance(step, Jitted):
            return step.donate == "state"
        step = step.func if isinstance(step, functools.partial) else getattr(step, "__wrapped__", None)
        if step is None:
            return False
    return False


def _fresh_copy(tree: Any) -> Any:
    """A copy of every tensor of `tree` (same dtype, device and requires_grad), for one donating call."""
    return tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad)
                    if isinstance(t, Tensor) else t, tree)


def assert_pure(step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Assert `step(*args, **kwargs)` is pure: repeatable bit for bit, inputs left unchanged.

    Calls `step` twice on the same inputs; the outputs must be bit-identical (NaNs in the same
    places count as equal) and no input tensor may change value or be written in place (its
    version counter must not move). A step made by `jit(..., donate="state")` (or wrapping one)
    overwrites its first argument by design: each call gets a fresh copy of it, the caller's
    `args[0]` is never touched, and every other input is checked as usual.

    Args:
        step: the function under test.
        *args: positional arguments (pytrees).
        **kwargs: keyword arguments (pytrees).

    Returns:
        The output of the first call (for a donating step, its state is the first call's copy).

    Raises:
        AssertionError: naming the input path that was modified (`args[0].params.w`), or the
            output leaf that differs between the calls.

    Example:
        >>> import torch
        >>> from ember.core.testing import assert_pure
        >>> assert_pure(lambda s, x: s + x, torch.ones(2), torch.ones(2)).tolist()
        [2.0, 2.0]
    """
    donated = bool(args) and _donates_state(step)

    def call() -> Any:
        call_args = (_fresh_copy(args[0]),) + args[1:] if donated else args
        return step(*call_args, **kwargs)

    snapshot = _tensor_snapshot(args, kwargs)
    first = call()
    _check_untouched(snapshot, "first")
    first_copy = tree_map(lambda t: _to_cpu(t).clone() if isinstance(t, Tensor) else t, first)
    second = call()
    _check_untouched(snapshot, "second")
    try:
        assert_trees_all_equal(tree_map(_to_cpu, second), first_copy)
    except AssertionError as e:
        raise AssertionError(
            f"step is not deterministic: two calls on the same inputs gave different outputs "
            f"(randomness must come from keys in the inputs, not the global RNG):\n{e}"
        ) from None
    return first
