"""torch's functional collectives: traceable, differentiable collectives on plain tensors.

torch ships them only as the private `torch.distributed._functional_collectives` (not released:
pytorch/pytorch#113669; WORKAROUNDS entry `functional_collectives`). torch 2.13 renamed
`all_gather_tensor` to `all_gather_single` (pytorch/pytorch#186125, the old name kept as a deprecated
alias); whichever name this torch has is taken. Import this module only where `torch.distributed` runs.
"""

from torch.distributed import _functional_collectives as _funcol

__all__ = ["all_gather", "all_gather_autograd", "all_to_all_single_autograd", "broadcast", "wait_tensor"]

all_gather = getattr(_funcol, "all_gather_single", None) or _funcol.all_gather_tensor
"""`all_gather(x, gather_dim, group)`: every process's `x` concatenated along `gather_dim` (no gradient)."""

all_gather_autograd = getattr(_funcol, "all_gather_single_autograd", None) or _funcol.all_gather_tensor_autograd
"""As `all_gather`, differentiable: the gradient comes back reduce-scattered (summed)."""

all_to_all_single_autograd = _funcol.all_to_all_single_autograd
broadcast = _funcol.broadcast
wait_tensor = _funcol.wait_tensor
