"""F4, F11 and F13 rows of ``sglang-disagg-ext selftest --backend nixl``.

Every built-in NIXL scenario of the release (``scenarios.nixl`` where F4 is
live or patched; ``scenarios.nixl_newest`` where F11 is live; ``scenarios.nixl.f13_scenarios`` where
F13 is) runs once with the stock
``nixl`` name and once with ``nixl-ext`` through the transfer harness: real
NIXL over UCX on 127.0.0.1, CPU pools, one process per rank, decode checking
every element of its heads and the sentinels around them. ``options`` moves
the pools to a GPU and picks UCX's transports (``harness.transport.ucx_tls``).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.rows import make_row
from sglang_disagg_ext.selftest.scenarios.nixl_newest import (
    PASSTHROUGH_ROW,
    hook_not_run_reason,
    nixl_scenarios,
    passthrough_reason,
)


def _row(name, stock, ext, verified, seconds, fix: str = "F4", **extra) -> Dict:
    return make_row(name, fix, "nixl", stock, ext, verified, seconds, **extra)


def _with_hook(env: Optional[Dict[str, str]], hooks: Optional[str], builtin) -> Optional[Dict[str, str]]:
    """``env`` plus the scenario's test-only manager hooks (``test/support/prefill_faults.py``)."""
    if builtin.prefill_hook:
        env = dict(env or {}, SGLANG_HARNESS_PREFILL_HOOK=f"{hooks}:{builtin.prefill_hook}")
    if builtin.decode_hook:
        env = dict(env or {}, SGLANG_HARNESS_DECODE_MANAGER_HOOK=f"{hooks}:{builtin.decode_hook}")
    return env


def _verdict(result, passed) -> str:
    return "pass" if passed(result) else "fail"


def nixl_rows(timeout_s: Optional[float] = None, names: Optional[List[str]] = None, options=None,
              ext_only: bool = False) -> List[Dict]:
    """One row per built-in scenario: stock ``nixl`` vs ``nixl-ext`` on the installed SGLang.

    ``names`` limits the run to those scenarios. On a release where the plugin
    passes ``nixl-ext`` through to the stock classes there is nothing to
    compare: one "n/a" row says so. ``options``: a ``TransferOptions``
    (default TCP, CPU pools); once a run shows the engine or device cannot
    start here, the remaining scenarios are reported as not run.
    """
    import dataclasses

    from sglang_disagg_ext.selftest.harness.transport import TransferOptions
    from sglang_disagg_ext.selftest.runner import engine_start_failure, observed

    transfer = dataclasses.asdict((options or TransferOptions()).validated())
    policy = releases.current_policy()
    if not policy.routes("nixl"):
        # The one n/a row stands for the NIXL scenarios: shown only when one of them was asked for.
        if names is not None and not set(names) & {b.name for b in nixl_scenarios(policy)}:
            return []
        return [
            _row(
                PASSTHROUGH_ROW,
                "n/a",
                "n/a",
                False,
                0.0,
                note=passthrough_reason(policy),
            )
        ]
    from sglang_disagg_ext.selftest.harness.run import run_scenario
    from sglang_disagg_ext.selftest.runner import prefill_fault_hooks

    builtins = nixl_scenarios(policy)
    hooks = prefill_fault_hooks()
    rows = []
    start_failure = None
    for builtin in builtins:
        if names is not None and builtin.name not in names:
            continue
        if start_failure:
            rows.append(_row(builtin.name, "fail", "fail", False, 0.0, fix=builtin.fix,
                             ext_detail=f"not run: {start_failure}"))
            continue
        why = hook_not_run_reason(builtin, hooks)
        if why:
            rows.append(_row(builtin.name, "n/a", "n/a", False, 0.0, fix=builtin.fix, why=why))
            continue
        start = time.monotonic()
        scenario = builtin.build()
        if builtin.decode_backend_for_ext:
            stock_verdict = "n/a"  # a mixed run; its all-stock twin is another row
        elif ext_only:
            stock_verdict = "not run"
        else:
            stock = run_scenario(scenario, "nixl", timeout_s=timeout_s,
                                 extra_env=_with_hook(builtin.stock_env(), hooks, builtin), **transfer)
            stock_verdict = _verdict(stock, builtin.passed)
            failure = engine_start_failure(stock)
            if failure:
                start_failure = f"the engine did not start in scenario {builtin.name!r}: {failure}"
        ext = run_scenario(
            scenario,
            "nixl-ext",
            timeout_s=timeout_s,
            extra_env=_with_hook(builtin.ext_env(), hooks, builtin),
            decode_backend=builtin.decode_backend_for_ext,
            **transfer,
        )
        ext_ok = builtin.passed(ext)
        failure = engine_start_failure(ext)
        if failure and not start_failure:
            start_failure = f"the engine did not start in scenario {builtin.name!r}: {failure}"
        rows.append(
            _row(
                builtin.name,
                stock_verdict,
                "pass" if ext_ok else "fail",
                any(r.bytes_verified for r in ext.requests),
                time.monotonic() - start,
                fix=builtin.fix,
                stock_expected="n/a" if builtin.decode_backend_for_ext else builtin.stock_expectation(policy),
                ext_detail=None if ext_ok else ext.describe(logs=False),
                **observed(ext),
            )
        )
    return rows
