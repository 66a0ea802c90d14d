"""Remember, per machine, that Inductor's CPU vector-ISA probe passed, so later processes skip it.

Private to `jit(backend="inductor")`. Before its first CPU kernel, every process running Inductor
builds a tiny program per candidate ISA (cached on disk) and loads each one in a fresh Python
subprocess that imports torch, to prove the compiler and CPU agree: 3 subprocesses, 7.6 s of
the first step on this 2-core machine, paid again by every test run and every `launch/train.py`.
The answer only changes with the compiler, torch, or the CPU, so after one process has seen every
ISA the CPU reports pass the probe, a marker file keyed by exactly those (Inductor's own dry-compile
fingerprint plus the CPU's flags) lets later processes set `cpp.vec_isa_ok`, which Inductor
provides to skip the probe. Any ISA failing, or an Inductor without these internals, leaves the
probe to run as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Iterator, List, Optional

__all__ = ["vec_isa_probe_memo"]


def _candidates() -> Optional[List[object]]:
    """The ISAs the CPU reports, which the probe will check, or None where that cannot be told."""
    import platform

    from torch._inductor import cpu_vec_isa as isa

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = isa.x86_isa_checker()
    return [v for v in isa.supported_vec_isa_list if all(f in flags for f in str(v).split())]


def _marker(candidates: List[object]) -> str:
    from torch._inductor import cpu_vec_isa as isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    arch_flags = " ".join(v.build_arch_flags() for v in candidates)  # type: ignore[attr-defined]
    key = isa._get_isa_dry_compile_fingerprint(arch_flags) + "|" + ",".join(map(str, candidates))
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "ember", f"vec_isa_ok.{digest}")


@contextlib.contextmanager
def vec_isa_probe_memo() -> Iterator[None]:
    """Skip Inductor's CPU ISA probe where a marker says it passed; leave a marker when it does."""
    from torch._inductor import config

    try:
        candidates = _candidates() if config.cpp.vec_isa_ok is None else None
        marker = _marker(candidates) if candidates else None
    except (AttributeError, ImportError, OSError):  # another torch's internals: probe as usual
        marker = None
    if marker is None:
        yield
        return
    if not os.path.exists(marker):
        from torch._inductor import cpu_vec_isa as isa

        if [str(v) for v in isa.valid_vec_isa_list()] != [str(v) for v in candidates]:
            yield  # some ISA failed the probe: Inductor keeps checking in every process
            return
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w") as f:
            f.write("every ISA the CPU reports passed Inductor's build-and-load probe\n")
    # Always compile under the flag, also in the process that ran the probe: it is part of
    # Inductor's cache key, and one setting keeps the on-disk cache hitting across processes.
    with config.patch({"cpp.vec_isa_ok": True}):
        yield
