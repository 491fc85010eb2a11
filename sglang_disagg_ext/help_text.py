"""Help text for the command line: docstrings used as ``--help`` read as plain text.

The CLI and the deploy tools (launch-pd, gsm8k, tiny-model, mini_lb) take their
descriptions from their module docstrings, which use reStructuredText markup.
"""

import re

# reStructuredText markup the docstrings use (``literal``, :func:`name`): --help shows them as plain text.
_RST_LITERAL = re.compile(r"(?::[a-z]+:)?``?([^`]+?)``?")


def plain_text(text):
    """``text`` (a docstring used as --help text) with its reStructuredText markup taken off."""
    return _RST_LITERAL.sub(r"\1", text) if text else text
