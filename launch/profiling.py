"""Profiling a run: a torch.profiler trace of chosen steps and a memory snapshot.

Public names: `ProfileConfig`, `StepProfiler`, `XlaStepProfiler`.

`--profile.steps 3:5` records steps 3 to 5 (both included) with `torch.profiler` into
`<out>/profile/trace_steps_3-5.json`, a Chrome trace whose `ProfilerStep#N` spans are the run's steps N:
open it at https://ui.perfetto.dev (or chrome://tracing). `--profile.memory` adds memory: on CUDA an
allocator snapshot of the same steps (`ember.core.compat.cuda_memory`, into
`<out>/profile/memory_snapshot.pickle`, for https://pytorch.org/memory_viz); on the CPU the profiler's
memory table (`profile_memory=True`, into `<out>/profile/memory_table.txt`). The profiler only observes:
the compiled step is called as without it (same bits, same compiles).

Example:
    >>> ProfileConfig(steps="3:5").range
    (3, 5)
    >>> ProfileConfig(steps="5:3")
    Traceback (most recent call last):
    ...
    ValueError: --profile.steps '5:3': the first step 5 is after the last 3; pass A:B with 1 <= A <= B, e.g. --profile.steps 3:5.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Tuple

import torch

from ember.core.compat.cuda_memory import dump_memory_snapshot, record_memory_history, stop_memory_history

__all__ = ["ProfileConfig", "StepProfiler", "XlaStepProfiler"]

_EXAMPLE = "pass A:B with 1 <= A <= B, e.g. --profile.steps 3:5"


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """`--profile.steps A:B` traces steps A to B (Chrome / Perfetto trace under out/profile); `--profile.memory` a memory snapshot."""

    steps: str = ""
    """Steps to trace, `A:B` (both included); "": none."""
    memory: bool = False
    """Also record memory over the traced steps: a CUDA memory snapshot on a GPU; on the CPU, what the allocator reports."""

    def __post_init__(self) -> None:
        if self.steps:
            _parse(self.steps)
        if self.memory and not self.steps:
            raise ValueError("--profile.memory records memory over the traced steps, but --profile.steps is not set; "
                             "pass --profile.steps A:B too, e.g. --profile.steps 3:5 --profile.memory.")

    @property
    def range(self) -> Optional[Tuple[int, int]]:
        """`(A, B)` of `steps`, or None when no step is traced."""
        return _parse(self.steps) if self.steps else None

    def check(self, *, steps: int, start: int = 0) -> None:
        """Raise ValueError (one line, with the fix) unless the traced steps lie in `start + 1 .. steps`.

        Args:
            steps: the run's last step (`--steps`).
            start: the step the run resumes from (0: a fresh run).
        """
        if self.range is None:
            return
        first, last = self.range
        if last > steps:
            raise ValueError(f"--profile.steps '{self.steps}' ends after the run's last step {steps}; pass a range "
                             f"within 1:{steps}, e.g. --profile.steps {min(first, steps)}:{steps}, or raise --steps to {last}.")
        if first <= start:
            raise ValueError(f"--profile.steps '{self.steps}' starts at step {first}, but the run resumes after step "
                             f"{start}; pass a range within {start + 1}:{steps}, e.g. --profile.steps "
                             f"{start + 1}:{min(start + 1 + last - first, steps)}.")


def _parse(text: str) -> Tuple[int, int]:
    first, colon, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        raise ValueError(f"--profile.steps {text!r} is not A:B (two step numbers); {_EXAMPLE}.") from None
    if not colon:
        raise ValueError(f"--profile.steps {text!r} is not A:B (two step numbers); {_EXAMPLE}.")
    if a < 1:
        raise ValueError(f"--profile.steps {text!r}: steps count from 1, got {a}; {_EXAMPLE}.")
    if a > b:
        raise ValueError(f"--profile.steps {text!r}: the first step {a} is after the last {b}; {_EXAMPLE}.")
    return a, b


class StepProfiler:
    """Drives `torch.profiler` over the steps `config.steps` of `train_loop` (`step_started` / `step_done`).

    The profiler starts one step early when it can (a warmup step, not recorded) and is stepped with
    `prof.step()` after each run step, with `step_num` set to the run's step number, so the trace's
    `ProfilerStep#N` is run step N. The trace is written when step B ends (or when the loop stops).

    Args:
        config: which steps, and whether memory too.
        out: the run directory (files go under `<out>/profile`).
        device: the device the step runs on (CUDA adds GPU activity and the memory snapshot).
        say: prints the line naming the files.
    """

    def __init__(self, config: ProfileConfig, out: str | os.PathLike, *, device: Any = "cpu",
                 say: Callable[[str], None] = print) -> None:
        self.config, self.device, self.say = config, torch.device(device), say
        self.first, self.last = config.range
        self.directory = os.path.join(os.fspath(out), "profile")
        self.trace_path = os.path.join(self.directory, f"trace_steps_{self.first}-{self.last}.json")
        self._prof: Any = None
        self._done = False
        self._warm_from = self.first
        self._cuda_memory = config.memory and self.device.type == "cuda"

    def _schedule(self, n: int) -> Any:
        from torch.profiler import ProfilerAction

        if n < self._warm_from or n > self.last:
            return ProfilerAction.NONE
        if n < self.first:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD_AND_SAVE if n == self.last else ProfilerAction.RECORD

    def _written(self, prof: Any) -> None:
        os.makedirs(self.directory, exist_ok=True)
        prof.export_chrome_trace(self.trace_path)
        wrote = [self.trace_path]
        if self.config.memory and not self._cuda_memory:
            path = os.path.join(self.directory, "memory_table.txt")
            with open(path, "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=40) + "\n")
            wrote.append(path)
        self.say(f"profile: steps {self.first}-{self.last} traced into {', '.join(wrote)}; open the trace at "
                 f"https://ui.perfetto.dev (or chrome://tracing)")

    def step_started(self, i: int) -> None:
        """Before run step `i` (before its batch is read)."""
        if self._prof is None and not self._done and self.first - 1 <= i <= self.last:
            from torch.profiler import ProfilerActivity, profile

            self._warm_from = i  # one warmup step when step A - 1 runs here (not the run's first: its compile)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=activities, schedule=self._schedule, on_trace_ready=self._written,
                                 profile_memory=self.config.memory, record_shapes=self.config.memory)
            self._prof.step_num = i - 1  # as torchtitan: the profiler's step number is the run's
            self._prof.start()
            self._prof.step()  # now at step i: ProfilerStep#i wraps it
        if self._cuda_memory and i == self.first:
            record_memory_history(max_entries=100_000)

    def step_done(self, i: int) -> None:
        """After run step `i` (logged, checkpointed)."""
        if self._prof is None:
            return
        if self._cuda_memory and i == self.last:
            self._dump_cuda_memory()
        self._prof.step()  # after step B: records and writes the trace
        if i >= self.last:
            self.close()

    def _dump_cuda_memory(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, "memory_snapshot.pickle")
        dump_memory_snapshot(path)
        stop_memory_history()
        self._cuda_memory = False
        self.say(f"profile: memory snapshot of steps {self.first}-{self.last} in {path}; open it at "
                 f"https://pytorch.org/memory_viz")

    def close(self) -> None:
        """Stop the profiler (a loop that stopped inside the range writes what it recorded). Idempotent."""
        if self._cuda_memory and self._prof is not None:
            self._dump_cuda_memory()
        if self._prof is not None:
            prof, self._prof, self._done = self._prof, None, True
            prof.stop()


class XlaStepProfiler:
    """`--profile.steps A:B` on torch_xla: `torch_xla.debug.profiler.start_trace` at step A, `stop_trace` after B.

    The trace goes to `<out>/profile/plugins/profile/<time>/<host>.trace.json.gz` (Chrome trace, for
    https://ui.perfetto.dev; the `.xplane.pb` beside it is for TensorBoard's profile plugin, or XProf), each
    step inside a `ProfilerStep#N` annotation. Stopping waits for the device (`wait_device_ops`: one host sync,
    after step B) so the trace holds the steps' execution. Same interface as `StepProfiler`.
    """

    def __init__(self, config: ProfileConfig, out: str | os.PathLike, *, say: Callable[[str], None] = print) -> None:
        self.config, self.say = config, say
        self.first, self.last = config.range
        self.directory = os.path.join(os.fspath(out), "profile")
        self._on, self._step = False, None

    def step_started(self, i: int) -> None:
        """Before run step `i`."""
        import torch_xla.debug.profiler as xp

        if i == self.first and not self._on:
            os.makedirs(self.directory, exist_ok=True)
            xp.start_trace(self.directory)
            self._on = True
        if self._on:
            self._step = xp.Trace(f"ProfilerStep#{i}")
            self._step.__enter__()

    def step_done(self, i: int) -> None:
        """After run step `i`."""
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self._on and i >= self.last:
            self.close()

    def close(self) -> None:
        """Stop the trace (idempotent)."""
        if not self._on:
            return
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.profiler as xp

        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        xm.wait_device_ops()  # host sync: once, after the last traced step
        xp.stop_trace()
        self._on = False
        self.say(f"profile: steps {self.first}-{self.last} traced into {self.directory}/plugins/profile/ "
                 f"(*.trace.json.gz); open it at https://ui.perfetto.dev")
