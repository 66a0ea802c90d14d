"""Subprocess body for tests/partition_specs/test_xla_matrix.py: SPMD requested after the runtime started.

Run with `PJRT_DEVICE=CPU CPU_NUM_DEVICES=2`. Prints one JSON object: the error type and message
of building an xla Sharding after `torch_xla.device()` and an XLA tensor already exist.
"""

import json

import torch
import torch_xla

from ember.core.mesh import Mesh
from ember.core.partition_specs import Sharding, for_mesh

if __name__ == "__main__":
    early = torch.ones(3, 5).to(torch_xla.device())
    mesh = Mesh.parse("dp=2", devices=2, backend="xla")
    try:
        Sharding(mesh, for_mesh(mesh.names))
        print(json.dumps({"error": None}))
    except RuntimeError as err:
        print(json.dumps({"error": [type(err).__name__, str(err)]}))
