#!/usr/bin/env python3
"""What CI runs, derived from the release table and the recorded probe values (no SGLang needed).

    python3 scripts/ci_plan.py matrix            # the releases CI builds, oldest first
    python3 scripts/ci_plan.py tests <release>   # the test paths of that release's leg
    python3 scripts/ci_plan.py families          # every family: representative, members, live fixes

The *full* leg (``releases.FULL_LEGS``: the newest release) runs the whole suite. The other legs
are the fewest releases that prove every live fix on every recorded release
(``releases.covering_releases``: a fix's run proves it on every release where it meets the same
code, so each (fix, code) pair runs once, on the oldest CI release that has it); each runs the
release-facts check and the differential tests of the fixes it proves (``fix_registry.tests_for``).
Releases with patches/ also run the patch stages. A new fix or release enters through the tables.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_disagg_ext import fix_registry, releases  # noqa: E402



def full_releases():
    if releases.FULL_LEGS != (releases.NEWEST_KNOWN,):
        raise SystemExit(f"ci_plan: releases.FULL_LEGS {releases.FULL_LEGS} is not the newest release")
    return list(releases.FULL_LEGS)


def matrix():
    full_releases()
    # Every patched release needs a leg for its patch check (today each is in ci_matrix already).
    patched = {d for d in os.listdir(os.path.join(ROOT, "patches")) if os.path.isdir(os.path.join(ROOT, "patches", d))}
    return sorted(set(releases.ci_matrix()) | patched, key=releases.Version)


def tests(release):
    """Test paths for ``release``'s leg; none for a full leg (``make test``: pyproject's testpaths)."""
    if release in full_releases():
        return []
    return list(fix_registry.tests_for(releases.proved_on(release)))


def main(argv):
    if argv[:1] == ["matrix"]:
        print(" ".join(matrix()))
    elif argv[:1] == ["tests"] and len(argv) == 2:
        print(" ".join(tests(argv[1])))
    elif argv[:1] == ["families"]:
        ci = matrix()
        for leg in ci:
            kind = "full" if leg in releases.FULL_LEGS else "family"
            print(f"{leg:<14} {kind:<6} proves: {' '.join(releases.proved_on(leg))}")
        for version in releases._ACTIVE_RELEASES:
            if releases.family_key(version) is None:
                continue
            by = {f: releases.proving_release(version, f, tuple(ci)) for f in releases.PROVEN
                  if releases._proves(version, f)}
            print(f"  {version:<14} " + " ".join(f"{f}<-{v}" for f, v in by.items()))
        unrecorded = [v for v in releases._ACTIVE_RELEASES if releases.family_of(v) is None]
        if unrecorded:
            print(f"no recorded probe values (no family): {' '.join(unrecorded)}")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
