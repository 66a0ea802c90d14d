"""`to_dict`: a (nested) config dataclass as a JSON-serialisable dict, each dataclass's type named.

Checkpoints record the model's and the run's configs with it, so a checkpoint names the model it
holds and `launch/ckpt.py` can rebuild it.

Example:
    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class Tiny:
    ...     width: int = 8
    ...     dims: tuple = (1, 2)
    >>> to_dict(Tiny())
    {'__type__': 'Tiny', 'width': 8, 'dims': [1, 2]}
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict

__all__ = ["to_dict"]


def to_dict(cfg: Any) -> Dict[str, Any]:
    """A JSON-serialisable dict of a (nested) config, with each dataclass's type name recorded."""

    def conv(x: Any) -> Any:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            d = {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
            return {"__type__": type(x).__name__, **d}
        if isinstance(x, (list, tuple)):
            return [conv(v) for v in x]
        if isinstance(x, dict):
            return {str(k): conv(v) for k, v in x.items()}
        if isinstance(x, (str, int, float, bool)) or x is None:
            return x
        return repr(x)

    out = conv(cfg)
    json.dumps(out)  # fail here, not when a checkpoint is written
    return out
