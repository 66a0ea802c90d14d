"""The launchers' own flags, split from the run config's flags (tyro parses those), and their exit.

    args, overrides = launcher_parser().parse_known_args(argv)
    cfg = read_config(args, overrides, description=__doc__)
    ...
    if __name__ == "__main__":
        sys.exit(run_main(main))   # errors as one `error: ...` line, exit 2

`--config NAME` picks a registered run config (`--list-configs` lists them), `--import PKG`
(repeatable) imports a user's package first so its families, archs, configs and collators register,
`--mesh` names the mesh, `--resume` continues from the latest checkpoint under `--out` and
`--resume_step N` from step N. `--help` shows these, the run config's flags and the configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Any, Callable, Optional, Sequence

from ember.core.partition_specs import MESH_ORDER
from ember.data import source_from_path
from ember.launch.interrupt import RunInterrupted
from ember.launch.quiet import quiet_known_noise
from ember.launch.run_config import TrainConfig, describe_configs, parse_cli

__all__ = ["USER_ERRORS", "launcher_parser", "read_config", "run_main"]

# What a mistake in a flag, a file or a checkpoint raises; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, TypeError, LookupError, OSError, NotImplementedError)  # LookupError: KeyError too


def launcher_parser() -> argparse.ArgumentParser:
    """The flags every launcher shares; a launcher adds its own with `add_argument(..., help=...)`."""
    p = argparse.ArgumentParser(add_help=False, usage=argparse.SUPPRESS)
    p.add_argument("--config", default="llama3_tiny", metavar="NAME", help="registered run config (default: llama3_tiny)")
    p.add_argument("--list-configs", action="store_true", help="list the registered run configs and exit")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="PKG",
                   help="import PKG first: it registers its own families, configs, collators (repeatable)")
    p.add_argument("--mesh", default=None, metavar="AXES",
                   help=f"device mesh, e.g. dp=2,tp=2 (axes {', '.join(MESH_ORDER)}; sizes multiply to the device count)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --out")
    p.add_argument("--resume_step", "--resume-step", type=int, default=None, metavar="N",
                   help="continue from checkpoint step N (e.g. when the latest is damaged); later steps are set aside")
    return p


def _configs_text() -> str:
    return "\n".join(f"  {name:<16} {line}" for name, line in describe_configs().items())


def read_config(args: argparse.Namespace, overrides: Sequence[str], *, description: str,
                parser: Optional[argparse.ArgumentParser] = None) -> TrainConfig:
    """Import the `--import` packages, then the `--config` run config with `overrides` applied.

    `--list-configs` prints the registered configs and exits; `--help` shows the launcher's own flags
    (from `parser`) and the configs above the run config's flags.
    """
    for name in args.imports:
        importlib.import_module(name)  # registers the user's families, archs, configs, collators
    if getattr(args, "resume_step", None) is not None:
        args.resume = True  # --resume_step N is a resume
    if getattr(args, "list_configs", False):
        print(f"run configs (--config NAME):\n{_configs_text()}")
        raise SystemExit(0)
    if {"-h", "--help"} & set(overrides):
        flags = (parser or launcher_parser()).format_help().strip()
        description = f"{description}\nLauncher {flags}\n\nRun configs (--config NAME):\n{_configs_text()}\n"
    cfg = parse_cli(args.config, overrides, description=description)
    _check_source_and_path(cfg, overrides)
    return dataclasses.replace(cfg, data=source_from_path(cfg.data))  # a --data.path alone names its source


def _check_source_and_path(cfg: TrainConfig, overrides: Sequence[str]) -> None:
    """Refuse `--data.source stdlib` given together with a data path: the path would silently win."""
    named = any(a.startswith("--") and a[2:].split("=", 1)[0].replace("-", "_") == "data.source" for a in overrides)
    if named and cfg.data.source == "stdlib" and cfg.data.path is not None:
        raise ValueError(f"--data.source stdlib reads the embedded corpus and no path, but data.path={cfg.data.path!r} "
                         f"is set too; drop --data.source to train on that path (its source is found from it), or "
                         f"drop --data.path to train on the stdlib corpus.")


def _message(error: BaseException) -> str:
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(str(text).split()) or type(error).__name__


def run_main(main: Callable[[], Any]) -> int:
    """Run a launcher's `main()` and return its exit code (its int result, else 0); a user error is
    printed as one `error: ...` line and returns 2.

    The message is ember's own (it names the value and the fix). `EMBER_DEBUG=1` re-raises with the
    traceback. A run stopped by a signal (`RunInterrupted`, after its final checkpoint) prints where it
    stopped and returns 130 (SIGINT) or 143 (SIGTERM); a second Ctrl-C returns 130 at once. Under
    torchrun only rank 0 prints.
    """
    quiet = os.environ.get("RANK", "0") != "0"
    quiet_known_noise()  # torch's lines that are noise on a CPU (ember.launch.quiet)
    try:
        result = main()
    except RunInterrupted as stopped:
        if not quiet:
            print(f"{stopped}", file=sys.stderr)
        return stopped.exit_code
    except KeyboardInterrupt:
        if not quiet:
            print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except USER_ERRORS as error:
        if os.environ.get("EMBER_DEBUG"):
            raise
        if not quiet:
            print(f"error: {_message(error)} (EMBER_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0
