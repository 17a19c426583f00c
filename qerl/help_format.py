"""The help format of every qerl command: descriptions as written, and each option's default."""

from __future__ import annotations

import argparse
import copy


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Names the default of every option that has one and whose help does not already say
    it; unlike argparse's ArgumentDefaultsHelpFormatter, also of options without help
    text, which argparse lists bare."""

    def _format_action(self, action: argparse.Action) -> str:
        said, default = action.help or "", action.default
        # `is`, not `in`: a default of 0 equals False
        unsaid = (default is None or default is False or default == []
                  or default == argparse.SUPPRESS)
        if action.option_strings and not unsaid and "default" not in said:
            action = copy.copy(action)
            action.help = f"{said}; default: %(default)s" if said else "default: %(default)s"
        return super()._format_action(action)
