"""Which build of the plugin this is: its version and the commit it was built from.

``make wheel`` writes ``_commit.txt`` into the package before building, so an installed wheel
knows its commit; a checkout (an editable install) asks git. ``--version`` and the
``sglang_disagg_ext_info`` metric carry it, so two builds of one version can be told apart.
"""

from __future__ import annotations

import functools
import os
import subprocess

from sglang_disagg_ext import __version__

_HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=1)
def commit() -> str:
    """The short commit this build came from, ``"unknown"`` where neither source says."""
    try:
        with open(os.path.join(_HERE, "_commit.txt"), encoding="utf-8") as f:
            text = f.read().strip()
            if text:
                return text
    except OSError:
        pass
    try:
        out = subprocess.run(["git", "-C", _HERE, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def version_line() -> str:
    return f"{__version__} (commit {commit()})"
