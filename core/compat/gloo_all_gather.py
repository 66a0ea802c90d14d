"""All-gathers over gloo in ember's compiled graphs go through `_allgather_base`, not the coalesced work.

A patch (`WORKAROUNDS["gloo_all_gather_out"]`), on inside ember's own compiles on torch 2.9 to 2.15.
`_c10d_functional.all_gather_into_tensor` (what DTensor's Shard -> Replicate emits, so every FSDP
parameter gather of a compiled DTensor step) reaches gloo as `allgather_into_tensor_coalesced`,
whose work corrupts the host heap when several of them are queued at once: glibc then aborts a
process at a later, unrelated `malloc`/`free` ("malloc(): unaligned tcache chunk detected", "double
free or corruption", or SIGSEGV in `tcache_get`). Inductor issues a step's gathers early and waits
late, so they queue. Measured in plain torch, no ember (`tests/core/_gloo_all_gather_worker.py
repro`: two gloo processes, one gloo worker thread, 8 functional all-gathers in flight then their
waits, 5000 times, on an idle 2-core machine): `all_gather_into_tensor` aborted 6 of 6 runs on
torch 2.15 and 1 of 3 on torch 2.9 (16 in flight: 4 of 4); `all_gather_into_tensor_out` (gloo's
`_allgather_base`) under the same load 0 of 6 on each, c10d's `all_gather_into_tensor(async_op=True)`
0 of 4. Fewer runs abort on a busy machine. The launcher's README command
`torchrun --nproc-per-node 4 launch/train.py --mesh fsdp=4 --steps 50` aborted 5 of 6 runs.

Within `gloo_all_gather_out()` (while a process group exists), Inductor's post-grad graph has each
such gather of a CPU tensor over a gloo group replaced by `all_gather_into_tensor_out` into a fresh
buffer: the same values, still asynchronous (the graph's `wait_tensor` waits for it), the op
Inductor's own all-gather bucketing emits. Only gathers of the graph's inputs (parameter shards, and
views of them) are replaced, the ones Inductor issues early: with the `_out` op, gathers of
activations computed in the step (context parallelism's keys and values) came out wrong once
Inductor reused buffers (`cp=2` losses off by up to 6e-3 on torch 2.15; right with
`allow_buffer_reuse=False`). Those keep the plain op; at most two of them (a layer's keys and values)
are in flight at once, never the queue that aborts. The pass has a uuid, so its graphs have their own cache
key. Without a process group the block changes nothing (no collective, same cache key).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional

import torch

__all__ = ["gloo_all_gather_out", "rewrite_gloo_all_gathers"]

_UUID = "ember-gloo-all-gather-out-3"


def _is_gloo(group_name: Any) -> bool:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group, get_backend

        return "gloo" in str(get_backend(_resolve_process_group(group_name)))  # "gloo", "cpu:gloo,cuda:nccl"
    except Exception:  # an unknown group name, or no process group: leave the node alone
        return False


_VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "permute", "t", "slice", "select", "squeeze", "unsqueeze",
          "alias", "clone", "contiguous", "expand", "as_strided"}


def _reads_graph_input(node: Any) -> bool:
    """True if `node` is a graph input (a parameter's shard), or a view or copy of one."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", "")
        if name not in _VIEWS or not node.args:
            return False
        node = node.args[0]
    return isinstance(node, torch.fx.Node) and node.op == "placeholder"


def rewrite_gloo_all_gathers(graph: torch.fx.Graph) -> int:
    """Replace gloo `all_gather_into_tensor` nodes of CPU tensors by the `_out` op; returns how many."""
    ops = torch.ops._c10d_functional
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not ops.all_gather_into_tensor.default:
            continue
        inp, group_size, group_name = node.args[:3]
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.device.type != "cpu" or not _is_gloo(group_name):
            continue
        if not _reads_graph_input(inp):  # an activation (context parallelism's keys): left as it is
            continue
        with graph.inserting_before(node):
            out = graph.call_function(torch.ops.aten.empty.memory_format, (list(val.shape),),
                                      {"dtype": val.dtype, "device": val.device})
            out.meta["val"] = val
            gathered = graph.call_function(ops.all_gather_into_tensor_out.default,
                                           (inp, group_size, group_name), {"out": out})
        gathered.meta.update(node.meta)
        node.replace_all_uses_with(gathered)
        graph.erase_node(node)
        count += 1
    return count


@functools.lru_cache(maxsize=None)
def _pass_class() -> Optional[type]:
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return None

    class _GlooAllGatherOut(CustomGraphPass):
        def __init__(self, before: Any) -> None:
            self.before = before  # a post-grad pre-pass that was already configured runs first

        def __call__(self, graph: torch.fx.Graph) -> None:
            if self.before is not None:
                for p in self.before if isinstance(self.before, (list, tuple)) else [self.before]:
                    p(graph)
            rewrite_gloo_all_gathers(graph)

        def uuid(self) -> Any:
            if self.before is None:
                return _UUID
            before = self.before if isinstance(self.before, (list, tuple)) else [self.before]
            uuids = [p.uuid() if hasattr(p, "uuid") else None for p in before]
            return None if None in uuids else (_UUID, *uuids)  # None: Inductor bypasses its cache

    return _GlooAllGatherOut


@contextlib.contextmanager
def gloo_all_gather_out() -> Iterator[None]:
    """Within the block, Inductor's gloo all-gathers use `_allgather_base` (see the module doc)."""
    from torch._inductor import config

    cls = _pass_class()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield  # no process group, no collective in the graph: Inductor's config (and cache key) as is
        return
    if cls is None or not hasattr(config, "post_grad_custom_pre_pass"):  # another torch: as it is
        yield
        return
    with config.patch(post_grad_custom_pre_pass=cls(config.post_grad_custom_pre_pass)):
        yield
