"""Start a launcher's ranks on this machine itself, so a multi-process run exits as one process does.

    python launch/train.py --nproc-per-node 4 --mesh fsdp=2,tp=2 --out runs/tp

`launch/train.py --nproc-per-node N` checks the whole run first (flags, mesh against N, the layout against
the model, the run directory: one `error: ...` line and exit 2 before any rank starts), then
`run_ranks` starts N copies of the script with the environment torchrun gives its workers (`RANK`,
`LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`: `env://` rendezvous on 127.0.0.1) and
waits. Its exit code is the run's: 0; a rank's own 2 (a mistake; rank 0 printed it), 130 / 143 (Ctrl-C /
SIGTERM, after the final checkpoint; rank 0 printed where and how to resume); else the failing rank's
code, with one line naming that rank. torchrun's own failure report is not printed (torchrun itself exits
1 whatever its workers return).

Signals: Ctrl-C reaches every rank from the terminal (one process group), and each stops after the
current step as in one process; a second Ctrl-C quits at once. A SIGINT or SIGTERM sent to this process
alone is passed on as SIGTERM (ranks that already stop ignore it). When a rank fails, the others get a
few seconds to fail the same way, then are killed: their collectives would wait for it forever.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["EXIT_CODES_OF_THE_RUN", "check_nproc", "checked", "quiet", "run_ranks"]

EXIT_CODES_OF_THE_RUN = (2, 130, 143)
"""Exit codes a rank returns for the whole run (a mistake, Ctrl-C, SIGTERM): returned as they are."""

_GRACE_S = 5.0
"""How long the other ranks may take to end on their own after one rank failed, before they are killed."""


_CHECKED = "EMBER_RANKS_CHECKED"
"""Set in the ranks' environment: the launcher checked the run (and printed its notices) before starting them."""


def checked() -> bool:
    """True in a rank `run_ranks` started: its launcher already checked the run and printed the notices."""
    return os.environ.get(_CHECKED) == "1"


def quiet(text: str) -> None:
    """A `say` that prints nothing (ranks other than 0)."""


def check_nproc(nproc: int) -> int:
    """`nproc` if it is a process count (>= 1); else a ValueError naming the fix."""
    if nproc < 1:
        raise ValueError(f"--nproc-per-node {nproc}: expected the number of processes to start (>= 1), one per "
                         f"device, e.g. --nproc-per-node 4.")
    return nproc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world: int, port: int, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment torchrun gives rank `rank` of `world` on one machine (`env://` on 127.0.0.1:`port`)."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), **{_CHECKED: "1"})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))  # ranks share the cores
    return env


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _Ranks:
    """The rank processes and their exit codes, in the order they ended."""

    def __init__(self, procs: List[subprocess.Popen]) -> None:
        self.procs = procs
        self.ended: List[tuple] = []  # (rank, code)

    def poll(self) -> None:
        done = {r for r, _ in self.ended}
        for rank, proc in enumerate(self.procs):
            if rank not in done and proc.poll() is not None:
                self.ended.append((rank, proc.returncode))

    def running(self) -> List[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def send(self, signum: int) -> None:
        for proc in self.running():
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def first_failure(self) -> Optional[tuple]:
        return next(((r, c) for r, c in self.ended if c != 0), None)


def _exit_code(ranks: _Ranks, *, killed: bool, say) -> int:
    """The run's exit code from its ranks' (the first failure is the cause; the others followed it)."""
    failure = ranks.first_failure()
    if failure is None:
        return 0
    rank, code = failure
    if code in EXIT_CODES_OF_THE_RUN:
        return code  # rank 0 printed the one line (every rank meets the same checks)
    if code < 0:
        say(f"error: rank {rank} of {len(ranks.procs)} died of {_signal_name(code)} (exit {code})"
            f"{'; the other ranks were stopped' if killed else ''}")
        return 128 - code
    say(f"error: rank {rank} of {len(ranks.procs)} failed with exit code {code} (its output is above)"
        f"{'; the other ranks were stopped' if killed else ''}")
    return code


def run_ranks(nproc: int, command: Sequence[str], *, poll_s: float = 0.05, say=None) -> int:
    """Run `command` (e.g. `[sys.executable, script, *argv]`) as ranks 0..nproc-1 of one process group here;
    the run's exit code (see the module docstring)."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    port = _free_port()
    procs = [subprocess.Popen(list(command), env=rank_environment(r, nproc, port)) for r in range(nproc)]
    ranks, signalled, killed = _Ranks(procs), [], False

    def forward(signum, frame):  # from the terminal the ranks have it already; from `kill` they do not
        signalled.append(signum)
        ranks.send(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed_at = None
        while ranks.running():
            time.sleep(poll_s)
            ranks.poll()
            if failed_at is None and ranks.first_failure() is not None and not signalled:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > _GRACE_S and ranks.running():
                killed = True
                ranks.send(signal.SIGKILL)  # they wait for the failed rank in a collective
        ranks.poll()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for proc in ranks.running():
            proc.kill()
            proc.wait()
    return _exit_code(ranks, killed=killed, say=say)
