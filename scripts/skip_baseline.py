#!/usr/bin/env python3
"""The skips each CI leg is allowed: test/skip_baseline.json, compared with a leg's log.

    python3 scripts/skip_baseline.py check <log> <release>    # exit 1 on a skip the baseline lacks
    python3 scripts/skip_baseline.py update <log> <release>   # write that leg's skips as its baseline

A leg's log is ``make ci-release``'s output: its "--- ci-release <release>: <stage> ---" lines
split it into stages, and pytest's ``-ra`` summary lists every skip as
``SKIPPED [count] <path>:<line>: <reason>``. A skip is keyed by its path and reason (not the
line, which moves with every edit). ``check`` fails when a stage skips a key the baseline does
not list, or more times than it lists, and prints the difference: a test that starts skipping
on a leg is a change someone has to accept by updating the baseline in a commit.
"""

import json
import os
import re
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(ROOT, "test", "skip_baseline.json")
STAGE = re.compile(r"^--- ci-release \S+: ([a-z0-9-]+) ---$")
SKIP = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+):\d+: (.*)$")


def skips(log_text):
    """stage -> Counter of "path: reason"."""
    out, stage = {}, None
    for line in log_text.splitlines():
        m = STAGE.match(line.strip())
        if m:
            stage = m.group(1)
            out.setdefault(stage, Counter())
            continue
        m = SKIP.match(line.strip())
        if m and stage:
            out[stage][f"{m.group(2)}: {m.group(3).strip()}"] += int(m.group(1))
    return out


def load():
    try:
        with open(BASELINE, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def main(argv):
    if len(argv) != 3 or argv[0] not in ("check", "update"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, log, release = argv
    with open(log, encoding="utf-8", errors="replace") as f:
        seen = skips(f.read())
    baseline = load()
    if mode == "update":
        baseline[release] = {stage: dict(sorted(c.items())) for stage, c in sorted(seen.items())}
        with open(BASELINE, "w", encoding="utf-8") as f:
            json.dump(dict(sorted(baseline.items())), f, indent=1)
            f.write("\n")
        print(f"skip baseline for {release}: {sum(sum(c.values()) for c in seen.values())} skips written")
        return 0
    allowed = baseline.get(release)
    if allowed is None:
        print(f"skip baseline: no entry for {release} in test/skip_baseline.json")
        return 1
    bad = 0
    for stage, counter in sorted(seen.items()):
        base = allowed.get(stage, {})
        for key, n in sorted(counter.items()):
            if n > base.get(key, 0):
                bad += 1
                print(f"skip baseline: {release} {stage}: NEW {n} x {key} (baseline {base.get(key, 0)})")
        for key, n in sorted(base.items()):
            if counter.get(key, 0) < n:
                print(f"skip baseline: {release} {stage}: fewer: {counter.get(key, 0)} x {key} (baseline {n})")
    print(f"skip baseline: {release}: {'FAILED, ' + str(bad) + ' new' if bad else 'ok'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
