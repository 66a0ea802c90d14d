"""The launchers' own flags, split from the run config's flags (tyro parses those), and their exit.

    args, overrides = launcher_parser().parse_known_args(argv)
    cfg = read_config(args, overrides, description=__doc__)
    ...
    if __name__ == "__main__":
        sys.exit(run_main(main))   # errors as one `error: ...` line, exit 2

`--config NAME` picks a registered run config, `--import PKG` (repeatable) imports a user's package
first so its families, archs, configs and collators register, `--mesh` names the mesh and
`--resume` continues from the latest checkpoint under `--out`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable, Sequence

from ember.launch.run_config import TrainConfig, parse_cli

__all__ = ["USER_ERRORS", "launcher_parser", "read_config", "run_main"]

# What a mistake in a flag, a file or a checkpoint raises; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, TypeError, LookupError, OSError, NotImplementedError)  # LookupError: KeyError too


def launcher_parser() -> argparse.ArgumentParser:
    """The flags every launcher shares; a launcher adds its own with `add_argument`."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", default="llama3_tiny")
    p.add_argument("--import", dest="imports", action="append", default=[])
    p.add_argument("--mesh", default=None)
    p.add_argument("--resume", action="store_true")
    return p


def read_config(args: argparse.Namespace, overrides: Sequence[str], *, description: str) -> TrainConfig:
    """Import the `--import` packages, then the `--config` run config with `overrides` applied."""
    for name in args.imports:
        importlib.import_module(name)  # registers the user's families, archs, configs, collators
    return parse_cli(args.config, overrides, description=description)


def _message(error: BaseException) -> str:
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(str(text).split()) or type(error).__name__


def run_main(main: Callable[[], Any]) -> int:
    """Run a launcher's `main()` and return its exit code (its int result, else 0); a user error is
    printed as one `error: ...` line and returns 2.

    The message is ember's own (it names the value and the fix). `EMBER_DEBUG=1` re-raises with the
    traceback. Ctrl-C prints one line and returns 130. Under torchrun only rank 0 prints.
    """
    quiet = os.environ.get("RANK", "0") != "0"
    try:
        result = main()
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
