"""The launchers' own flags, split from the run config's flags (tyro parses those).

    args, overrides = launcher_parser().parse_known_args(argv)
    cfg = read_config(args, overrides, description=__doc__)

`--config NAME` picks a registered run config, `--import PKG` (repeatable) imports a user's package
first so its families, archs, configs and collators register, `--mesh` names the mesh and
`--resume` continues from the latest checkpoint under `--out`.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Sequence

from ember.launch.run_config import TrainConfig, parse_cli

__all__ = ["launcher_parser", "read_config"]


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
