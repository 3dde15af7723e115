"""The ``kvgate`` command line: one subcommand per module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gateway.cli import calibrate, demo, emulate, epp, load, plan, serve, simulate
from gateway.core.errors import KvgateError

_COMMANDS = (demo, serve, epp, emulate, load, simulate, plan, calibrate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="KV-cache-aware routing gateway and simulator for vLLM fleets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in _COMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except KvgateError as exc:
        print(f"kvgate {args.command}: error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"kvgate {args.command}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
