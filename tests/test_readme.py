"""Every command the README shows runs as written: each ``snakemake`` command as a dry run
(``-n``: GPU configurations and the paper's grid cannot run here, and the smoke run is CI's
own step), each ``qerl`` command through qerl's own parsers (every option known, every value
of its type and choices, the repository files it names present). The set-up lines (venv,
pip) and ``python -m pytest`` are what CI runs (.ci/run); the image's commands are .ci/image's.
And the README's first table is the one ``qerl report`` wrote."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex

import pytest

from qerl.bench import registry
from qerl.cli import build_parser
from tests.test_workflow import ROOT, snakemake

README = ROOT / "README.md"
# Commands CI runs as its own steps, not from here: the set-up, the tests, the image.
CI_STEPS = ("python3 -m venv", ". .venv/bin/activate", "pip ", "python -m pytest", "docker ")


def fenced_commands(text: str) -> list[str]:
    """The shell commands of the README's ```bash blocks: continued lines joined, comments
    dropped, each part of an && chain its own command."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            command = []
            for word in [*words, "&&"]:
                if word == "&&":
                    if command:
                        commands.append(shlex.join(command))
                    command = []
                else:
                    command.append(word)
    return commands


def inline_commands(text: str) -> list[str]:
    """Commands quoted in the prose: `snakemake ...`, and `qerl ...` with options (a bare
    `qerl eval` names a verb, it is no command)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [span for span in spans
            if span.startswith("snakemake ") or (span.startswith("qerl ") and " --" in span)]


COMMANDS = fenced_commands(README.read_text()) + inline_commands(README.read_text())


def test_the_readme_shows_commands_of_each_kind():
    kinds = {c.split()[0] for c in COMMANDS}
    assert {"snakemake", "qerl"} <= kinds
    assert len([c for c in COMMANDS if c.startswith("snakemake")]) >= 6


def _ids(commands: list[str]) -> list[str]:
    return [c if len(c) < 90 else c[:87] + "..." for c in commands]


SNAKEMAKE = [c for c in COMMANDS if c.startswith("snakemake ")]


@pytest.mark.parametrize("command", SNAKEMAKE, ids=_ids(SNAKEMAKE))
def test_each_snakemake_command_runs_dry(command):
    words = shlex.split(command)[1:]
    if not {"-n", "--dry-run"} & set(words):  # a dry run needs no cores; a real one does
        assert {"--cores", "-c", "--jobs", "-j", "--profile"} & set(words), \
            f"{command}: Snakemake refuses a local run without --cores"
    if "--profile" in words:  # a cluster's executor, maybe not installed: the grid it runs
        at = words.index("--profile")
        words = words[:at] + words[at + 2:]
    done = snakemake(*words, "-n")
    assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
    assert "Nothing to be done" in done.stdout + done.stderr or "Job stats" in done.stdout \
        + done.stderr, command


QERL = [c for c in COMMANDS if c.startswith("qerl ")]


def _benchmark_parser(module: str) -> argparse.ArgumentParser:
    """The parser a benchmark's main() builds (caught before it parses)."""
    built = {}

    class Built(Exception):
        pass

    def catch(self, *args, **kwargs):
        built["parser"] = self
        raise Built

    real = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        importlib.import_module(module).main([])
    except Built:
        pass
    finally:
        argparse.ArgumentParser.parse_args = real
    return built["parser"]


@pytest.mark.parametrize("command", QERL, ids=_ids(QERL))
def test_each_qerl_command_parses(command):
    words = [w for w in shlex.split(command)[1:] if w != "..."]  # "..." stands for more
    try:
        args = build_parser().parse_args(words)
    except SystemExit as done:  # --version and --help exit, having said it
        assert done.code == 0, command
        return
    if args.verb == "bench":
        _benchmark_parser(registry.COMMANDS[args.what]).parse_args(args.args)
    for word in words:
        value = word.partition("=")[2] or word
        if value.startswith("workflows/"):
            assert (ROOT / value).exists(), f"{command}: {value} is not in the repository"


def test_the_set_up_and_test_commands_are_cis_own():
    ci = (ROOT / ".ci" / "run").read_text()
    others = [c for c in COMMANDS if not c.startswith(("snakemake ", "qerl "))]
    assert others and all(c.startswith(CI_STEPS) for c in others), others
    assert "python -m pytest" in ci and "snakemake" in ci


def test_each_table_the_readme_shows_is_the_one_qerl_report_wrote():
    """Refresh them with `qerl report --results results`, then copy each results/tables
    file between the README's two markers that name it (<!-- results/tables/NAME.md -->
    and <!-- /results/tables/NAME.md -->); the status table comes first."""
    text = README.read_text()
    shown = re.findall(r"<!-- (results/tables/\w+\.md) -->\n(.*?)<!-- /\1 -->", text,
                       re.DOTALL)
    names = [name for name, _ in shown]
    assert names[:1] == ["results/tables/status.md"], names
    for name, table in shown:  # blank lines around it: a table
        assert table == f"\n{(ROOT / name).read_text()}\n", f"the README's {name} is stale"
    assert text.index(shown[0][1]) < text.index("## Install")  # on the first screen
