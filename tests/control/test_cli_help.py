"""Every option of every `residency` command says what it does in `--help`."""
from __future__ import annotations

import argparse

from residency.control.cli.main import build_parser


def _parsers(parser: argparse.ArgumentParser, path: str):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            missing.append(f"{path}: {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_of_every_command_has_help_text():
    commands = dict(_parsers(build_parser(), "residency"))
    for must in ("serve", "status", "ctl", "replay", "diagnose", "audit", "timeline", "report", "ledger", "simulate"):
        assert f"residency {must}" in commands, f"`residency {must}` is not registered"
    assert any(p.startswith("residency ledger ") for p in commands), "the ledger subcommands are not walked"
    missing = [m for path, p in commands.items() for m in _undocumented(p, path)]
    assert not missing, "options without help text:\n  " + "\n  ".join(missing)


def test_every_subcommand_has_help_text():
    missing = []
    for path, parser in _parsers(build_parser(), "residency"):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                documented = {c.dest for c in action._choices_actions if (c.help or "").strip()}
                missing += [f"{path} {name}" for name in action.choices if name not in documented]
    assert not missing, "subcommands without help text: " + ", ".join(missing)
