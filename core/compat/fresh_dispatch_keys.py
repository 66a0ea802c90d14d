"""A new thread's dispatch keys, forced on this one: for a compile started inside a running op's kernel.

Access (`WORKAROUNDS["fresh_dispatch_keys"]`). A rolled loop's body compiles on its first call,
inside the `ember::rolled_loop` kernel of the step's running graph, where the dispatcher excludes
keys that tracing needs (ADInplaceOrView, PythonTLSSnapshot, Functionalize). The exclusions are
thread-local, so a new thread would have the keys; but a compile on another thread deadlocked
when the caller was importing a module (a step run at a test file's top level): Inductor's cache
key pickles `torch.contiguous_format`, pickle looks the name up through `sys.modules`, finds it in
the half-imported module and imports it, which waits for the caller (python/cpython#76171). So the
keys a new thread starts with are read once, and forced on the compiling thread instead.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator, Tuple

import torch

__all__ = ["fresh_thread_keys"]


@functools.lru_cache(maxsize=None)
def _keys_of_a_new_thread() -> Tuple[Any, Any]:
    found = []
    reader = threading.Thread(target=lambda: found.append(
        (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())))
    reader.start()
    reader.join()
    return found[0]


@contextlib.contextmanager
def fresh_thread_keys() -> Iterator[None]:
    """Within the block, this thread dispatches with the keys a new thread starts with."""
    with torch._C._ForceDispatchKeyGuard(*_keys_of_a_new_thread()):
        yield
