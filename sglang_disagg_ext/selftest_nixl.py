"""F4 rows of ``sglang-disagg-ext selftest --backend nixl``.

Every built-in NIXL scenario (``scenarios_nixl``) runs once with the stock
``nixl`` name and once with ``nixl-ext`` through the transfer harness: real
NIXL over UCX on 127.0.0.1, CPU pools, one process per rank, decode checking
every element of its heads and the sentinels around them.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

from sglang_disagg_ext import releases


def _row(name, stock, ext, verified, seconds, **extra) -> Dict:
    row = {
        "scenario": name,
        "fix": "F4",
        "backend": "nixl",
        "stock": stock,
        "ext": ext,
        "verified": bool(verified),
        "seconds": round(float(seconds), 2),
    }
    row.update(extra)
    return row


def _verdict(result, passed) -> str:
    return "pass" if passed(result) else "fail"


def nixl_rows(timeout_s: Optional[float] = None, names: Optional[List[str]] = None) -> List[Dict]:
    """One row per built-in scenario: stock ``nixl`` vs ``nixl-ext`` on the installed SGLang.

    ``names`` limits the run to those scenarios. On a release where the plugin
    passes ``nixl-ext`` through to the stock classes there is nothing to
    compare: one "n/a" row says so.
    """
    policy = releases.current_policy()
    if policy.support is not releases.Support.ACTIVE:
        return [
            _row(
                "nixl-ext routes to stock classes on this release",
                "n/a",
                "n/a",
                False,
                0.0,
                note=f"SGLang {policy.version}: {policy.support.value}",
            )
        ]
    from sglang_disagg_ext.harness.run import run_scenario
    from sglang_disagg_ext.scenarios_nixl import builtin_scenarios

    rows = []
    for builtin in builtin_scenarios():
        if names is not None and builtin.name not in names:
            continue
        start = time.monotonic()
        scenario = builtin.build()
        if builtin.decode_backend_for_ext:
            stock_verdict = "n/a"  # a mixed run; its all-stock twin is another row
        else:
            stock = run_scenario(scenario, "nixl", timeout_s=timeout_s, extra_env=builtin.stock_env())
            stock_verdict = _verdict(stock, builtin.passed)
        ext = run_scenario(
            scenario,
            "nixl-ext",
            timeout_s=timeout_s,
            extra_env=builtin.ext_env(),
            decode_backend=builtin.decode_backend_for_ext,
        )
        ext_ok = builtin.passed(ext)
        rows.append(
            _row(
                builtin.name,
                stock_verdict,
                "pass" if ext_ok else "fail",
                any(r.bytes_verified for r in ext.requests),
                time.monotonic() - start,
                stock_expected="n/a" if builtin.decode_backend_for_ext else builtin.stock_expectation(policy),
                ext_detail=None if ext_ok else ext.describe(logs=False),
            )
        )
    return rows
