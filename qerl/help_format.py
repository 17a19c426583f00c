"""The help format of every qerl command: descriptions as written (less the docstrings'
markup), and each option's default."""

from __future__ import annotations

import argparse
import copy
import re

# ``literal`` in a docstring (reStructuredText): a terminal shows the text alone.
LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def plain(text: str) -> str:
    """``text`` without reStructuredText's inline-literal quotes."""
    return LITERAL.sub(r"\1", text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Names the default of every option that has one and whose help does not already say
    it; unlike argparse's ArgumentDefaultsHelpFormatter, also of options without help
    text, which argparse lists bare. Descriptions (the modules' docstrings) and help texts
    lose their ``literal`` quotes."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _format_action(self, action: argparse.Action) -> str:
        said, default = action.help or "", action.default
        # `is`, not `in`: a default of 0 equals False
        unsaid = (default is None or default is False or default == []
                  or default == argparse.SUPPRESS)
        if action.option_strings and not unsaid and "default" not in said:
            action = copy.copy(action)
            action.help = f"{said}; default: %(default)s" if said else "default: %(default)s"
        if "``" in (action.help or ""):
            action = copy.copy(action)
            action.help = plain(action.help)
        return super()._format_action(action)
