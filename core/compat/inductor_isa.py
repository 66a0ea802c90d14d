"""Remember, per machine, which of Inductor's CPU vector-ISA probes passed, so later processes skip them.

A patch (`WORKAROUNDS["vec_isa_probe_memo"]`), on inside ember's own CPU compiles on torch 2.9 to 2.13:
torch 2.14 and 2.15 leave a marker per passed check themselves (measured by its test). Before its first CPU
kernel, every process running Inductor checks each ISA the CPU reports (AVX2, AVX-512, and where
present AVX-512-BF16, AMX, AMX-FP16) by building a tiny program (cached on disk) and loading it in a
fresh Python subprocess that imports torch, to prove the compiler and CPU agree: one subprocess per
check, 7.6 s of the first step on this 2-core machine, paid again by every test run and every
`launch/train.py`. A check's answer only changes with the compiler, torch, the flags and code it
builds, or the CPU; so a passed check leaves a marker keyed by exactly those (Inductor's own dry-
compile fingerprint, the probe's source, the CPU's flags), and later processes answer that check
from the marker. A failed check leaves nothing and runs again next time, as in plain Inductor.
Inductor's configuration is untouched, so its cache keys are the same in the process that probed and
in the ones that did not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
from typing import Any, Callable, Iterator, Optional
from unittest import mock

__all__ = ["vec_isa_probe_memo"]


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> str:
    """The CPU's feature flags as the kernel reports them ('' where /proc/cpuinfo has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _marker(arch_flags: str, code: str) -> str:
    from torch._inductor import cpu_vec_isa as isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = "\0".join((isa._get_isa_dry_compile_fingerprint(arch_flags), code, _cpu_flags()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "ember", f"vec_isa_ok.{digest}")


def _remembering(check_build: Callable[[Any, str], bool]) -> Callable[[Any, str], bool]:
    """`VecISA.check_build`, answered from a marker when this machine already passed that check."""

    @functools.wraps(check_build)
    def remembered(self: Any, code: str) -> bool:
        try:
            marker: Optional[str] = _marker(self._arch_flags, code)
        except (AttributeError, ImportError, OSError):  # another torch's internals: probe as usual
            marker = None
        if marker is not None and os.path.exists(marker):
            return True
        passed = check_build(self, code)
        if passed and marker is not None:
            with contextlib.suppress(OSError):  # a read-only cache only costs the next probe
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                with open(marker, "w") as f:
                    f.write("this ISA check passed Inductor's build-and-load probe on this machine\n")
        return passed

    return remembered


def _in_background(probe: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        with contextlib.suppress(Exception):  # the caller's own call then fails or probes again
            probe()

    return threading.Thread(target=run, name="ember-inductor-isa-probe", daemon=True)


@contextlib.contextmanager
def vec_isa_probe_memo() -> Iterator[None]:
    """Answer Inductor's ISA checks from this machine's markers; leave a marker for each that passes.

    The checks start at once on a background thread (they wait on subprocesses), so a first probe
    overlaps the work done before Inductor's first kernel (tracing, graph passes); Inductor's first
    ISA query waits for them.
    """
    try:
        from torch._inductor import cpu_vec_isa as isa

        check_build, valid_vec_isa_list = isa.VecISA.check_build, isa.valid_vec_isa_list
    except (AttributeError, ImportError):  # another torch's internals: probe as usual
        yield
        return
    probe = _in_background(valid_vec_isa_list)

    def after_probe() -> Any:
        probe.join()
        return valid_vec_isa_list()  # cached by Inductor once the probe is done

    with mock.patch.object(isa.VecISA, "check_build", _remembering(check_build)), \
            mock.patch.object(isa, "valid_vec_isa_list", after_probe):
        probe.start()
        try:
            yield
        finally:
            probe.join()
