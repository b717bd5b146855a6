"""The ``pmz`` command. Errors users can cause end in one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import sys

from models.common.config import UnsupportedConfigError
from models.common.sources import CheckpointError
from parallel.config import ParallelConfigError


def _cmd_inspect(args: argparse.Namespace) -> int:
    from converters.inspect import inspect_checkpoint

    info = inspect_checkpoint(args.path)
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key == "parameters":
            value = f"{value:,}"
        elif key == "bytes":
            value = f"{value:,} ({value / 2**20:.1f} MiB)"
        print(f"{key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pmz", description="Parallel model zoo checkpoint tools (CPU only).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="format, architecture, parallel layout, parameter count, dtypes, size")
    p.add_argument("path")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ParallelConfigError, UnsupportedConfigError, FileNotFoundError) as exc:
        print(f"pmz {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
