"""ember.core.checkpoint: save and restore training states on orbax, bit for bit.

Public names: `CheckpointManager`, `CheckpointMeta`, `CheckpointError`, `LeafSpec`, `model_info`; for tools
that read a checkpoint directory without a manager, `TMP_MARKER`, `temporary_dirs`, `disk_bytes`.

A checkpoint holds everything a bit-identical resume needs: params, optimizer state (with its
hyperparameter tensors and counters), step, RNG key, the data iterator's state, the run config and
the model's family / arch. Saves are asynchronous and atomic; restores check the template against
the saved metadata before reading arrays and verify a CRC-32 per array; `verify(step)` checks a
step without restoring it. See `manager.py`.

Example:
    >>> import tempfile, torch
    >>> with tempfile.TemporaryDirectory() as d:
    ...     ckpt = CheckpointManager(d, save_every=1, max_to_keep=2)
    ...     for step in (1, 2, 3):
    ...         _ = ckpt.save(step, {"params": {"w": torch.full((2,), float(step))}})
    ...     ckpt.wait()
    ...     steps = ckpt.all_steps()
    ...     params = ckpt.restore_params()
    ...     ckpt.close()
    >>> steps, params
    ([2, 3], {'w': tensor([3., 3.])})
"""

from ._layout import TMP_MARKER as TMP_MARKER
from ._layout import disk_bytes as disk_bytes
from ._layout import temporary_dirs as temporary_dirs
from ._meta import CheckpointError as CheckpointError
from ._meta import CheckpointMeta as CheckpointMeta
from ._meta import model_info as model_info
from ._tree import LeafSpec as LeafSpec
from .manager import CheckpointManager as CheckpointManager

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointMeta", "LeafSpec", "TMP_MARKER", "disk_bytes", "model_info",
           "temporary_dirs"]
