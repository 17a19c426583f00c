"""Every qerl command's --help names each option's default."""

from __future__ import annotations

import argparse
import importlib

import pytest

from qerl.bench.registry import COMMANDS
from qerl.cli import build_parser


class _Built(Exception):
    pass


def parsers_of(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers_of(sub)


def benchmark_parser(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser a benchmark's main() builds, caught as it parses."""
    built = {}

    def catch(self, *args, **kwargs):
        built["parser"] = self
        raise _Built

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Built):
        importlib.import_module(module).main([])
    return built["parser"]


def undocumented_defaults(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    return [action.option_strings[0] for action in parser._actions
            if action.option_strings and action.default not in (None, [], argparse.SUPPRESS)
            and action.default is not False
            and "default" not in formatter._format_action(action)]


def test_every_command_names_its_defaults():
    for parser in parsers_of(build_parser()):
        assert undocumented_defaults(parser) == [], parser.prog


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_benchmark_names_its_defaults(name, monkeypatch):
    parser = benchmark_parser(COMMANDS[name], monkeypatch)
    assert undocumented_defaults(parser) == []


def test_argparse_alone_would_hide_them():
    """The check above sees what it checks: argparse's own formatter lists these bare."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")
    parser.add_argument("--device", help="default: cuda if available")
    assert undocumented_defaults(parser) == ["--steps", "--rank"]


def test_help_shows_no_docstring_markup(monkeypatch):
    """Descriptions come from docstrings: their ``literal`` quotes are dropped, and a
    command continued over lines with a backslash keeps its lines."""
    parsers = [*parsers_of(build_parser()),
               *(benchmark_parser(module, monkeypatch) for module in COMMANDS.values())]
    for parser in parsers:
        text = parser.format_help()
        assert "``" not in text, parser.prog
        lines = [line for line in text.splitlines() if line.lstrip().startswith("qerl ")]
        assert all(len(line) <= 100 for line in lines), (parser.prog, lines)
