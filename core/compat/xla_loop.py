"""A rolled loop on torch_xla: `fn(carry, x)` over the leading dim of `xs` as one XLA `While`.

Read access to torch_xla's forward-only scan (`WORKAROUNDS["xla_while_loop"]`). Its public
`torch_xla.experimental.scan` differentiates the body with AOTAutograd, which a body that takes
its own gradients (a microbatch's `value_and_grad`) does not need and ember's pure steps do not
fit; `gradient_accumulation` accumulates into an `nn.Module`'s `.grad`. The loop body is traced
once, whatever the trip count, so the step's graph and its compile time stay flat in it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from . import warn_once

__all__ = ["xla_fold", "xla_scan"]

_HANDLE_MOVED = "Parameter ID must exist for device data"


def xla_scan(fn: Callable[[Any, Any], Tuple[Any, Any]], init: Any, xs: Any) -> Optional[Tuple[Any, Any]]:
    """`jax.lax.scan` of `fn(carry, x) -> (carry, y)` over `xs` as one XLA `While`: the last carry and
    the stacked `y`s, or None where torch_xla has no such loop (the caller unrolls).

    `init` and `xs` are pytrees of XLA tensors; `fn` must return a carry shaped like `init`.
    """
    try:
        from torch_xla.experimental.scan import _scan_impl_pytree
    except ImportError as err:
        warn_once("xla_while_loop", f"torch_xla has no forward-only scan ({err}); loops unroll.")
        return None

    try:
        return _scan_impl_pytree(fn, init, xs)
    except RuntimeError as err:
        if _HANDLE_MOVED not in str(err):
            raise
    # A tensor the body reads was still being computed (the last step's outputs, an input sync)
    # when the loop was lowered, and its buffer arrived before torch_xla looked it up again: a
    # pending tensor's handle is its own address until then (pytorch/xla#8785). Seen once, in CI
    # under load. With the device idle no handle moves, so the second trace finds them all.
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()
    return _scan_impl_pytree(fn, init, xs)


def xla_fold(fn: Callable[[Any, Any], Any], init: Any, xs: Any) -> Optional[Any]:
    """The final carry of `fn` folded over `xs` in one XLA `While`, or None (as `xla_scan`)."""
    out = xla_scan(lambda c, x: (fn(c, x), None), init, xs)
    return None if out is None else out[0]
