"""Entry point of the ``residency`` console script.

Each command module registers itself; errors that are the user's (a bad URL, a file that is
not a ledger, a corrupt row) are printed as one line naming the problem, with a non-zero exit
and no traceback. A bug still shows its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from residency.control.logconfig import configure_logging

# module name under control.cli -> registered in this order in --help
COMMAND_MODULES = (
    "serve_cmd",
    "status_cmd",
    "ctl_cmd",
    "ledger_cmd",
    "replay_cmd",
    "timeline_cmd",
    "audit_cmd",
    "simulate_cmd",
    "diagnose_cmd",
    "report_cmd",
)


class UserError(Exception):
    """A problem with the user's input or environment, printed as one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="residency",
        description="Residency: an inference server whose memory moves are written to a replayable ledger.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"residency.control.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"residency.control.cli.{name}":
                continue          # command not built in this checkout
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from residency.ledger.errors import LedgerError  # noqa: PLC0415  (the ledger may not be importable yet)

    try:
        return int(args.func(args) or 0)
    except (UserError, LedgerError) as e:
        print(f"residency {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `residency timeline ... | head`: the reader left; not an error worth a traceback
        import os  # noqa: PLC0415

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"residency {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
