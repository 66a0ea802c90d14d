"""torch's rolled loop operator, `scan`, which torch exports only from a private module (WORKAROUNDS
entry `torch_scan`). ember's layers do not use it (its backward keeps every step's intermediates, and
its gradients are wrong on torch 2.9); `launch/bench_scale.py --torch-primitives` measures it."""

from torch._higher_order_ops.scan import scan as torch_scan

__all__ = ["torch_scan"]
