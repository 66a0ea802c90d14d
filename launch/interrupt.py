"""Graceful interruption: the first Ctrl-C (SIGINT) or SIGTERM ends a run after the step that is running.

    with GracefulStop() as stop:
        state = train_loop(..., should_stop=stop.requested)   # returns after the current step
        ...save the final checkpoint, flush metrics, plot...
        stop.raise_if_stopped(step=int(state.step), ...)      # RunInterrupted: one line, exit 130 / 143

A second Ctrl-C raises `KeyboardInterrupt` at once (`cli.run_main` exits 130). A SIGTERM after the
first signal is ignored: torchrun answers a Ctrl-C by sending SIGTERM to every worker, and that must
not cut the final checkpoint short. Under torchrun the ranks agree (`sharded.on_every_rank`) so all
of them stop after the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable, Optional

__all__ = ["GracefulStop", "RunInterrupted"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(Exception):
    """The run stopped early on a signal, after saving what it had; `exit_code` is 128 + the signal number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


def _say_on_rank_0(text: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets the signal; one reports
        print(text, file=sys.stderr, flush=True)


class GracefulStop:
    """Turns SIGINT / SIGTERM into a request the training loop polls between steps.

    Handlers are installed on `__enter__` (main thread only; elsewhere signals keep their handlers)
    and the previous ones restored on `__exit__`.
    """

    def __init__(self, say: Optional[Callable[[str], None]] = None) -> None:
        self.signum: Optional[int] = None
        self._say = say or _say_on_rank_0
        self._previous: dict = {}

    def requested(self) -> bool:
        """True once a signal asked the run to stop."""
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            self._say(f"\n{signal.Signals(signum).name} received: stopping after the current step "
                      f"(Ctrl-C again to quit at once)")
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def raise_if_stopped(self, *, step: int, steps: int, checkpoint_dir: Optional[str], saved_step: Optional[int]) -> None:
        """Raise `RunInterrupted` naming where the run stopped and how to continue it, if a signal came."""
        if self.signum is None:
            return
        where = f"stopped at step {step} of {steps} ({signal.Signals(self.signum).name})"
        if saved_step is not None:
            how = f"checkpoint saved at step {saved_step} in {checkpoint_dir}; continue with the same command and --resume"
        else:
            how = "no checkpoint (checkpoints are off): pass --out DIR --checkpoint_every N to be able to --resume"
        raise RunInterrupted(f"{where}: {how}", self.signum)
