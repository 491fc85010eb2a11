"""``sglang-disagg-ext selftest``: the built-in scenarios, stock vs ``-ext``, on the real engines.

An operator runs this on a node before switching the flag. Each row runs one
scenario with the stock backend name and with the ``-ext`` name and reports
whether each passed (bytes verified at the destination, sentinels untouched,
both sides in the expected final state). Exit status is non-zero if any
``-ext`` run fails.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from typing import Dict, List

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable

# Row keys, in table order.
COLUMNS = ("scenario", "fix", "backend", "stock", "ext", "verified", "seconds")


def _row(scenario, fix, backend, stock, ext, verified, seconds, **extra) -> Dict:
    row = {
        "scenario": scenario,
        "fix": fix,
        "backend": backend,
        "stock": stock,
        "ext": ext,
        "verified": bool(verified),
        "seconds": round(float(seconds), 2),
    }
    row.update(extra)
    return row


def mooncake_rows(policy, timeout_s: float) -> List[Dict]:
    from sglang_disagg_ext.harness.run import run_scenario
    from sglang_disagg_ext.scenarios_mooncake import scenarios_for

    rows = []
    for builtin in scenarios_for(policy):
        start = time.monotonic()
        scenario = builtin.build(policy)
        stock = run_scenario(scenario, "mooncake", timeout_s=timeout_s)
        ext = run_scenario(scenario, "mooncake-ext", timeout_s=timeout_s)
        rows.append(
            _row(
                builtin.name,
                builtin.fix,
                "mooncake",
                "pass" if builtin.evaluate(stock) else "fail",
                "pass" if builtin.evaluate(ext) else "fail",
                # Decode compared the pages byte for byte and they matched.
                any(r.bytes_verified for r in ext.requests),
                time.monotonic() - start,
                stock_expected=builtin.stock_expectation(policy),
                ext_detail=None if builtin.evaluate(ext) else ext.describe(logs=False),
            )
        )
    return rows


# backend -> (module, function) providing that backend's rows.
_ROW_SOURCES = {
    "mooncake": ("sglang_disagg_ext.selftest", "mooncake_rows"),
    "nixl": ("sglang_disagg_ext.selftest_nixl", "nixl_rows"),
    "mori": ("sglang_disagg_ext.selftest_mori", "mori_rows"),
}


def collect_rows(backends: List[str], timeout_s: float) -> List[Dict]:
    policy = releases.current_policy()
    rows: List[Dict] = []
    for backend in backends:
        module_name, func_name = _ROW_SOURCES[backend]
        func = getattr(importlib.import_module(module_name), func_name)
        if backend == "mooncake":
            rows.extend(func(policy, timeout_s))
        else:
            rows.extend(func())
    from sglang_disagg_ext.selftest_f5 import f5_rows

    rows.extend(f5_rows())
    return rows


def default_backends() -> List[str]:
    # mori's engine is ROCm-only; its rows run against an in-repo stand-in
    # engine and are included whenever that module reports it can run.
    out = [b for b in ("mooncake", "nixl") if engine_importable(b)]
    out.append("mori")
    return out


def format_table(rows: List[Dict]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in COLUMNS} if rows else {c: len(c) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines.append("  ".join("-" * widths[c] for c in COLUMNS))
    for r in rows:
        lines.append("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in COLUMNS))
    return "\n".join(lines)


def main(args) -> int:
    policy = releases.current_policy()
    try:
        policy.check_supported()
    except releases.UnsupportedSGLangRelease as exc:
        print(f"selftest: {exc}", file=sys.stderr)
        return 2
    if args.protocol != "tcp" or args.device != "cpu" or args.ib_device:
        # The harness builds CPU pools and forces TCP today; refusing beats
        # reporting a TCP/CPU result as if it were RDMA/GPU.
        print(
            "selftest: only --protocol tcp --device cpu is implemented by the transfer harness so far "
            f"(asked: protocol={args.protocol}, device={args.device}, ib_device={args.ib_device})",
            file=sys.stderr,
        )
        return 2
    backends = args.backend or default_backends()
    rows = collect_rows(backends, args.timeout)
    failed = [r for r in rows if r["ext"] == "fail"]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"SGLang {policy.version} ({policy.support.value}, {policy.layout.value} state layout)")
        print(format_table(rows))
        for r in failed:
            print(f"\nFAILED with -ext: {r['scenario']}\n{r.get('ext_detail') or ''}")
        for r in rows:
            if r.get("engine"):
                print(f"note [{r['scenario']}]: {r['engine']}")
        print(f"\n{len(rows) - len(failed)} of {len(rows)} -ext scenarios passed")
    return 1 if failed else 0
