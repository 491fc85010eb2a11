#!/usr/bin/env python3
"""Mixed-release pairs, by hand: prefill on one SGLang release, decode on another, real Mooncake over TCP.

    .venv/bin/python scripts/mixed_pair.py --decode-python .venv-0.5.23/bin/python

Runs with the interpreter that starts it for prefill (its venv's SGLang) and ``--decode-python``
for decode, through the transfer harness (``run_scenario(..., decode_python=...)``), for each
backend (stock ``mooncake`` and ``mooncake-ext`` on both sides) and two scenarios:

* ``served``: two valid requests; every byte checked at decode's pages;
* ``decode gives up first``: request 0 never admitted by prefill (decode's metadata arrives,
  decode's waiting timeout ends it and, from 0.5.22, decode tells prefill so), then a valid
  request 1, which shows whether prefill's bootstrap thread survived what decode sent.

Prints one line per run: each request's status on both sides, whether its bytes were verified,
and the plugin's or SGLang's first thread error. Its results are recorded in docs/fixes.md (F18,
F19). CI runs one mixed pair (prefill newer than decode, F19) in its own stage: ``make mixed``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sglang_disagg_ext import releases  # noqa: E402
from sglang_disagg_ext.selftest.harness.run import run_scenario  # noqa: E402
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, Timeouts  # noqa: E402


def scenarios():
    valid = [RequestSpec([1, 2], [3, 4], aux_index=1, dst_aux_index=2), RequestSpec([5], [6], aux_index=3,
                                                                                  dst_aux_index=4)]
    gives_up = [RequestSpec([1, 2], [3, 4], aux_index=1, dst_aux_index=2, prefill_admits=False),
                RequestSpec([5], [6], aux_index=3, dst_aux_index=4)]
    for name, reqs in (("served", valid), ("decode gives up first", gives_up)):
        yield Scenario(name=name, requests=reqs, kv=KVPoolSpec(num_pages=8), timeouts=Timeouts(request_s=40, startup_s=30.0, sglang_bootstrap_s=20.0))


def describe(result) -> str:
    if result.error:
        return f"error: {result.error}"
    parts = []
    for r in result.requests:
        parts.append(f"req {r.index} {r.prefill_status}/{r.decode_status}"
                     f"{' bytes ok' if r.bytes_verified else ''}")
    errors = [t for r in result.requests for t in r.thread_errors]
    if errors:
        parts.append(f"thread error: {errors[0][:160]}")
    return "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode-python", required=True, help="interpreter of the decode side (another venv)")
    ap.add_argument("--backends", default="mooncake,mooncake-ext")
    args = ap.parse_args()
    print(f"prefill: SGLang {releases.current_policy().version} ({sys.executable}); decode: {args.decode_python}")
    for backend in args.backends.split(","):
        for scn in scenarios():
            result = run_scenario(scn, backend, decode_python=args.decode_python, timeout_s=120)
            print(f"{backend:13s} {scn.name:22s} {result.wall_seconds:5.1f}s  {describe(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
