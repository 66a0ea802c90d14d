"""`TorchDispatchMode`: see every aten op a computation runs (ember's remat recording, leaf dependencies).

torch ships it only in the private `torch.utils._python_dispatch` (`__torch_function__` modes are public,
`__torch_dispatch__` modes are not: albanD/subclass_zoo#9; WORKAROUNDS entry `dispatch_mode`).
"""

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TorchDispatchMode"]
