#!/usr/bin/env python3
"""Record the installed SGLang release's probe values in sglang_disagg_ext/release_facts.json.

    <venv>/bin/python scripts/record_release_facts.py          # write this release's row
    <venv>/bin/python scripts/record_release_facts.py --check  # exit 1 if the row differs

Runs in one release's environment (``make release-facts`` runs it in every release's); the
MoRI stand-in (``test/support/mori_standin``) answers MoRI's imports where the real engine
(ROCm only) is absent, as in the tests. See ``releases.families``.
"""

import argparse
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("mori") is None:
        sys.path.insert(0, os.path.join(ROOT, "test", "support", "mori_standin"))
    from sglang_disagg_ext import releases

    version = releases.installed_sglang_version()
    if version is None:
        print("record_release_facts: SGLang is not installed here", file=sys.stderr)
        return 2
    live = releases.probe_record()
    try:
        with open(releases.FACTS_FILE, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        record = {}
    if args.check:
        differs = {k: (record.get(version, {}).get(k), v) for k, v in live.items()
                   if record.get(version, {}).get(k) != v}
        for name, (was, now) in differs.items():
            print(f"{version} {name}: recorded {was!r}, live {now!r}")
        return 1 if differs or version not in record else 0
    record[version] = live
    order = sorted(record, key=lambda v: releases.Version(v))
    with open(releases.FACTS_FILE, "w", encoding="utf-8") as f:
        json.dump({v: record[v] for v in order}, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"record_release_facts: {version}: {len(live)} probes recorded in {os.path.relpath(releases.FACTS_FILE, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
