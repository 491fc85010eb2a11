#!/usr/bin/env python3
"""The README's compatibility table, written from the release table (``releases.py``) and the CI
plan (``releases.ci_matrix``): never by hand.

    python3 scripts/readme_tables.py          # print the table
    python3 scripts/readme_tables.py --write  # put it between the README's compat markers

``test/unit/test_readme.py`` fails when the README's table is not this script's output.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_disagg_ext import releases  # noqa: E402

BEGIN, END = "<!-- compat:begin (scripts/readme_tables.py --write) -->", "<!-- compat:end -->"
MARK = {
    releases.FixStatus.LIVE: "**fix**",
    releases.FixStatus.UPSTREAM: "up",
    releases.FixStatus.NA: "-",
    releases.FixStatus.UNCOVERED: "open",
}


def _rows():
    """Consecutive releases with the same fix statuses, one row each."""
    ci = releases.ci_matrix()
    groups = []
    for version in releases._ACTIVE_RELEASES:
        policy = releases.policy_for(version)
        marks = tuple(MARK[policy.fixes[f]] for f in releases.FIXES)
        leg = "full" if version in releases.FULL_LEGS else ("family" if version in ci else "")
        if groups and groups[-1][1] == marks:
            groups[-1][0].append((version, leg))
        else:
            groups.append(([(version, leg)], marks))
    return groups


def compat_table() -> str:
    head = "| SGLang | " + " | ".join(releases.FIXES) + " |"
    lines = [head, "|" + "---|" * (len(releases.FIXES) + 1)]
    for versions, marks in _rows():
        names = ", ".join(f"{v} (CI)" if leg else v for v, leg in versions)
        lines.append(f"| {names} | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def block() -> str:
    return f"{BEGIN}\n{compat_table()}\n{END}"


def readme_block(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main(argv):
    if argv == ["--write"]:
        path = os.path.join(ROOT, "README.md")
        text = open(path).read()
        open(path, "w").write(text.replace(readme_block(text), block()))
    elif not argv:
        print(block())
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
