"""A rolled loop on torch_xla: `fn(carry, x)` over the leading dim of `xs` as one XLA `While`.

Read access to torch_xla's forward-only scan (`WORKAROUNDS["xla_while_loop"]`). Its public
`torch_xla.experimental.scan` differentiates the body with AOTAutograd, which a body that takes
its own gradients (a microbatch's `value_and_grad`) does not need and ember's pure steps do not
fit; `gradient_accumulation` accumulates into an `nn.Module`'s `.grad`. The loop body is traced
once, whatever the trip count, so the step's graph and its compile time stay flat in it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from . import warn_once

__all__ = ["inside_xla_fold", "xla_fold"]

_depth = [0]  # not thread-local: autograd may run the body's backward on its XLA device thread


def inside_xla_fold() -> bool:
    """Whether an `xla_fold` body is being traced here (remat leaves its optimization barrier out:
    one inside the While body makes torch_xla 2.9's CPU compile crash, measured)."""
    return _depth[0] > 0


def xla_fold(fn: Callable[[Any, Any], Any], init: Any, xs: Any) -> Optional[Any]:
    """The final carry of `fn` folded over `xs` in one XLA `While`, or None where torch_xla has no such loop.

    `init` and `xs` are pytrees of XLA tensors; `fn` must return a carry shaped like `init`.
    """
    try:
        from torch_xla.experimental.scan import _scan_impl_pytree
    except ImportError as err:  # a torch_xla without it: the caller unrolls
        warn_once("xla_while_loop", f"torch_xla has no forward-only scan ({err}); microbatches unroll.")
        return None
    def body(c: Any, x: Any) -> Any:
        _depth[0] += 1
        try:
            return fn(c, x), None
        finally:
            _depth[0] -= 1

    carry, _ = _scan_impl_pytree(body, init, xs)
    return carry
