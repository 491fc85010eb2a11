#!/usr/bin/env python3
"""What CI runs, derived from the release table and the recorded probe values (no SGLang needed).

    python3 scripts/ci_plan.py matrix            # the releases CI builds, oldest first
    python3 scripts/ci_plan.py tests <release>   # the test paths of that release's leg
    python3 scripts/ci_plan.py families          # every family: representative, members, live fixes

A *full* leg (a release with patches in patches/, or the default release) runs the whole
suite; every other family's representative runs the pure units, doctor, registration, metrics
and the differential tests of every fix live there (``fix_registry.tests_for``), so a new fix or
release cannot be left out: it enters through the tables.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_disagg_ext import fix_registry, releases  # noqa: E402

DEFAULT_RELEASE = "0.5.11"


def full_releases():
    patched = {d for d in os.listdir(os.path.join(ROOT, "patches")) if os.path.isdir(os.path.join(ROOT, "patches", d))}
    return sorted(patched | {DEFAULT_RELEASE}, key=releases.Version)


def matrix():
    chosen = set(full_releases())
    for rep, members in releases.families().items():
        if not chosen & set(members):
            chosen.add(rep)
    return sorted(chosen, key=releases.Version)


def tests(release):
    """Test paths for ``release``'s leg; none for a full leg (``make test``: pyproject's testpaths)."""
    if release in full_releases():
        return []
    return list(fix_registry.tests_for(releases.policy_for(release)))


def main(argv):
    if argv[:1] == ["matrix"]:
        print(" ".join(matrix()))
    elif argv[:1] == ["tests"] and len(argv) == 2:
        print(" ".join(tests(argv[1])))
    elif argv[:1] == ["families"]:
        ci = set(matrix())
        for rep, members in releases.families().items():
            ran = sorted(set(members) & ci, key=releases.Version)
            live = ",".join(releases.policy_for(rep).active_fixes())
            print(f"{rep:<14} CI: {' '.join(ran):<14} members: {' '.join(members)}  live: {live}")
        unrecorded = [v for v in releases._ACTIVE_RELEASES if releases.family_of(v) is None]
        if unrecorded:
            print(f"no recorded probe values (no family): {' '.join(unrecorded)}")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
