"""What the device-check stages share: the result line, the device, warning counts, tree digests.

Public names: `emit`, `count_warnings`, `digest`, `RESULT_PREFIX`. The device is `ember.core.device_for`'s;
waiting for it is `ember.launch.benchmark.setup.sync`.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any, Dict, List

import torch

from ember.core.pytree import tree_leaves

RESULT_PREFIX = "RESULT "


def emit(stage: str, result: Dict[str, Any]) -> None:
    """Print `RESULT <stage> {json}` on one line: `summary` reads every such line back from the log."""
    print(f"{RESULT_PREFIX}{stage} {json.dumps(result, default=str)}", flush=True)


def count_warnings(caught: List[warnings.WarningMessage]) -> Dict[str, int]:
    """`{"Category: first line of the message": count}` of warnings caught with `record=True`."""
    counts: Dict[str, int] = {}
    for w in caught:
        key = f"{w.category.__name__}: {str(w.message).strip().splitlines()[0][:180]}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def digest(tree: Any) -> str:
    """A short SHA-256 of every tensor leaf's bytes (same digest = bitwise the same tree)."""
    h = hashlib.sha256()
    for x in tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            h.update(x.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
