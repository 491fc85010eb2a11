"""``bench/results.json``: schema, verdicts and the printed table. Pure.

Required keys (issues #8, #18): ``ext_over_stock``, ``goodput_over_raw``,
``slice_build_over_stock``, ``offload_over_copy`` -- each a non-empty list of
``{"case": str, "ratio": positive finite float}``; the last two may instead be
:data:`NA_UPSTREAM` on a release where the fix they measure (F4, F5) is
upstream --, ``plugin_load_ms`` (a finite number), ``ext_cpu_overhead`` (a
non-empty list of ``{"case", "added_cpu_us", "transfer_us", "fraction"}``:
per request, the thread CPU time the ``-ext`` send path spends beyond stock's,
the stock transfer's own time, and their quotient) and ``fix_cpu_overhead``
(one row per fix measured on this release, ``{"case", "fix", "added_cpu_us",
"stock_cpu_us", "transfer_us", "fraction"}``, possibly empty). Everything else
(machine, units, per-case details with every sample) rides along under other
keys; :func:`check_samples` recomputes every figure from those samples.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from bench.stats import median, paired_ratios

RATIO_KEYS = ("ext_over_stock", "goodput_over_raw", "slice_build_over_stock", "offload_over_copy")
NA_ALLOWED = ("slice_build_over_stock", "offload_over_copy")
NA_UPSTREAM = "n/a: upstream on this release"
CPU_KEY = "ext_cpu_overhead"
CPU_KEYS = ("case", "added_cpu_us", "transfer_us", "fraction")
FIX_KEY = "fix_cpu_overhead"
FIX_KEYS = ("case", "fix", "added_cpu_us", "stock_cpu_us", "transfer_us", "fraction")
REQUIRED_KEYS = RATIO_KEYS + ("plugin_load_ms", CPU_KEY, FIX_KEY)
# Optional: verified/unverified ext transfer time (a list as RATIO_KEYS), or
# "n/a: <why>" where verification does not work on the release.
VERIFY_KEY = "verified_over_unverified"
# Added CPU per request at most this fraction of the transfer's time, judged at this many tokens.
CPU_TARGET = 0.02
CPU_TARGET_TOKENS = 8192

# (bound, "max" | "min"): a ratio meets the target when <= (max) or >= (min) it.
TARGETS: Dict[str, Optional[tuple]] = {
    "ext_over_stock": (1.02, "max"),
    "goodput_over_raw": (0.9, "min"),
    "slice_build_over_stock": (1.0, "max"),
    "offload_over_copy": None,  # the issue sets none: reported, not judged
    "verified_over_unverified": (1.10, "max"),
}


NO_VERDICT = "no verdict"


def verdict(key: str, ratio: float, q1: Optional[float] = None, q3: Optional[float] = None) -> str:
    """"yes" / "no" against the key's target; "no verdict" where the target lies
    inside the paired ratios' interquartile range [q1, q3] (noise could put the
    median on either side); "-" where there is no target."""
    target = TARGETS[key]
    if target is None:
        return "-"
    bound, kind = target
    if q1 is not None and q3 is not None and q1 <= bound <= q3:
        return NO_VERDICT
    return "yes" if ((ratio <= bound) if kind == "max" else (ratio >= bound)) else "no"


def cpu_verdict(tokens: int, concurrency: int, fraction: float) -> str:
    """Added CPU against :data:`CPU_TARGET`, judged at :data:`CPU_TARGET_TOKENS` tokens, one request."""
    if tokens != CPU_TARGET_TOKENS or concurrency != 1:
        return "-"
    return "yes" if fraction <= CPU_TARGET else "no"


def target_text(key: str) -> str:
    target = TARGETS[key]
    if target is None:
        return "-"
    bound, kind = target
    return f"<= {bound:g}" if kind == "max" else f">= {bound:g}"


def ratio_list(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The ``[{"case", "ratio"}]`` list of the schema from detail rows."""
    return [{"case": str(r["case"]), "ratio": float(r["ratio"])} for r in rows]


def _number(value, where: str, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise ValueError(f"{where} must be a {'positive' if positive else 'non-negative'} finite number, "
                         f"got {value!r}")


def _rows(results: Dict[str, Any], key: str, keys: Sequence[str], non_empty: bool) -> None:
    rows = results[key]
    if not isinstance(rows, list) or (non_empty and not rows):
        raise ValueError(f"{key} must be a {'non-empty ' if non_empty else ''}list, got {rows!r}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) != set(keys):
            raise ValueError(f"{key}[{i}] must have exactly the keys {', '.join(keys)}, got {row!r}")
        for k in ("case", "fix"):
            if k in keys and (not isinstance(row[k], str) or not row[k]):
                raise ValueError(f"{key}[{i}].{k} must be a non-empty string, got {row[k]!r}")
        _number(row["added_cpu_us"], f"{key}[{i}].added_cpu_us")
        _number(row["transfer_us"], f"{key}[{i}].transfer_us", positive=True)
        _number(row["fraction"], f"{key}[{i}].fraction")
        if "stock_cpu_us" in keys:
            _number(row["stock_cpu_us"], f"{key}[{i}].stock_cpu_us")


def validate(results: Dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first thing that does not fit the schema."""
    if not isinstance(results, dict):
        raise ValueError(f"results must be a JSON object, got {type(results).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in results]
    if missing:
        raise ValueError(f"results lack key(s) {missing}")
    _rows(results, CPU_KEY, CPU_KEYS, non_empty=True)
    _rows(results, FIX_KEY, FIX_KEYS, non_empty=False)
    for key in RATIO_KEYS + ((VERIFY_KEY,) if VERIFY_KEY in results else ()):
        rows = results[key]
        if key in NA_ALLOWED and rows == NA_UPSTREAM:
            continue
        if key == VERIFY_KEY and isinstance(rows, str) and rows.startswith("n/a: "):
            continue
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{key} must be a non-empty list, got {rows!r}")
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or set(row) != {"case", "ratio"}:
                raise ValueError(f"{key}[{i}] must have exactly the keys case and ratio, got {row!r}")
            if not isinstance(row["case"], str) or not row["case"]:
                raise ValueError(f"{key}[{i}].case must be a non-empty string, got {row['case']!r}")
            r = row["ratio"]
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
                raise ValueError(f"{key}[{i}].ratio must be a positive finite number, got {r!r}")
    ms = results["plugin_load_ms"]
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms):
        raise ValueError(f"plugin_load_ms must be a finite number, got {ms!r}")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def check_samples(results: Dict[str, Any]) -> None:
    """Recompute every figure of items 1, 2 and the CPU overhead lists from the samples that
    ``details`` lists for it; raise ``ValueError`` naming the first that does not match.

    * ``ext_over_stock``: median and quartiles of ext/stock over the listed pairs, as many
      pairs as ``repeats`` says;
    * ``goodput_over_raw``: median of raw/ext time (= ext/raw goodput) over the listed pairs;
    * ``verified_over_unverified`` (where a list): median and quartiles of verified/ext
      end-to-end time over the listed pairs; where the case lists read-floor samples, the
      read floor's read/ext median and quartiles and verified/read from the same rounds;
    * ``ext_cpu_overhead``: ``added_cpu_us`` the median of the case's listed per-sample added
      CPU, ``transfer_us`` the fastest listed stock per-request time, ``fraction`` their quotient;
    * ``fix_cpu_overhead``: the same per fix, ``stock_cpu_us`` the median of the listed stock
      CPU of the method(s) that fix wraps.
    """
    details = results.get("details") or {}
    transfer = {r["case"]: r for r in details.get("transfer", [])}
    for row in results["ext_over_stock"]:
        d = transfer.get(row["case"])
        if d is None:
            raise ValueError(f"ext_over_stock case {row['case']!r} lists no samples in details.transfer")
        s = d["samples_s"]
        if len(s["ext"]) != d["repeats"] or len(s["stock"]) != d["repeats"]:
            raise ValueError(f"{row['case']}: {len(s['ext'])}/{len(s['stock'])} samples listed, repeats {d['repeats']}")
        p = paired_ratios(s["ext"], s["stock"])
        for got, want, what in ((row["ratio"], p["median"], "ratio"), (d["ratio"], p["median"], "ratio"),
                                (d["ratio_q1"], p["q1"], "q1"), (d["ratio_q3"], p["q3"], "q3")):
            if not _close(got, want):
                raise ValueError(f"ext_over_stock {row['case']}: {what} {got} is not {want} from its samples")
    goodput = {r["case"]: r for r in details.get("goodput", [])}
    for row in results["goodput_over_raw"]:
        d = goodput.get(row["case"])
        if d is None:
            raise ValueError(f"goodput_over_raw case {row['case']!r} lists no samples in details.goodput")
        want = paired_ratios(d["samples_s"]["raw"], d["samples_s"]["ext"])["median"]
        if not _close(row["ratio"], want):
            raise ValueError(f"goodput_over_raw {row['case']}: ratio {row['ratio']} is not {want} from its samples")
    verified = {r["case"]: r for r in details.get("verified", [])}
    for row in results.get(VERIFY_KEY) if isinstance(results.get(VERIFY_KEY), list) else []:
        d = verified.get(row["case"])
        if d is None:
            raise ValueError(f"{VERIFY_KEY} case {row['case']!r} lists no samples in details.verified")
        s = d["samples_s"]
        if len(s["verified"]) != d["repeats"] or len(s["ext"]) != d["repeats"]:
            raise ValueError(f"{VERIFY_KEY} {row['case']}: {len(s['verified'])}/{len(s['ext'])} samples listed, "
                             f"repeats {d['repeats']}")
        p = paired_ratios(s["verified"], s["ext"])
        checks = [(row["ratio"], p["median"], "ratio"), (d["ratio_q1"], p["q1"], "q1"), (d["ratio_q3"], p["q3"], "q3")]
        if "read" in s or "read_ratio" in d:  # the read floor, where the run measured it
            if len(s.get("read", ())) != d["repeats"]:
                raise ValueError(f"{VERIFY_KEY} {row['case']}: {len(s.get('read', ()))} read-floor samples listed, "
                                 f"repeats {d['repeats']}")
            f = paired_ratios(s["read"], s["ext"])
            checks += [(d["read_ratio"], f["median"], "read_ratio"), (d["read_ratio_q1"], f["q1"], "read_ratio_q1"),
                       (d["read_ratio_q3"], f["q3"], "read_ratio_q3"),
                       (d["verified_over_read"], paired_ratios(s["verified"], s["read"])["median"],
                        "verified_over_read")]
        for got, want, what in checks:
            if not _close(got, want):
                raise ValueError(f"{VERIFY_KEY} {row['case']}: {what} {got} is not {want} from its samples")
    for row in results[CPU_KEY]:
        d = transfer.get(row["case"])
        if d is None or "cpu" not in d:
            raise ValueError(f"{CPU_KEY} case {row['case']!r} lists no CPU samples in details.transfer")
        _check_cpu_row(CPU_KEY, row, median(d["cpu"]["added_us"]), d)
    for row in results[FIX_KEY]:
        d = transfer.get(row["case"])
        if d is None or row["fix"] not in d.get("cpu", {}).get("by_fix_us", {}):
            raise ValueError(f"{FIX_KEY} {row['fix']} {row['case']!r} lists no CPU samples for that fix")
        _check_cpu_row(FIX_KEY, row, median(d["cpu"]["by_fix_us"][row["fix"]]), d)
        stock = fix_stock_cpu(d["cpu"], row["fix"])
        if not _close(row["stock_cpu_us"], stock):
            raise ValueError(f"{FIX_KEY} {row['fix']} {row['case']}: stock_cpu_us {row['stock_cpu_us']} is not "
                             f"{stock} from its samples")


def _check_cpu_row(key: str, row: Dict[str, Any], added: float, d: Dict[str, Any]) -> None:
    transfer_us = min(d["samples_s"]["stock"]) * 1e6
    for got, want, what in ((row["added_cpu_us"], added, "added_cpu_us"), (row["transfer_us"], transfer_us,
                            "transfer_us"), (row["fraction"], added / transfer_us, "fraction")):
        if not _close(got, want):
            raise ValueError(f"{key} {row['case']}: {what} {got} is not {want} from its samples")


def fix_methods(cpu: Dict[str, Any], fix: str) -> List[str]:
    """The stock methods ``fix``'s traced frames override (from the case's ``traced_labels``)."""
    labels = (cpu.get("traced_labels") or {}).get("plugin", [])
    return sorted({lab.rsplit(".", 1)[-1] for lab in labels if lab.split(" ", 1)[0] == fix})


def fix_stock_cpu(cpu: Dict[str, Any], fix: str) -> float:
    """Median per-request CPU (us) that the stock manager spends in the methods ``fix``
    overrides, on the same transfer (0.0 where it has none)."""
    per = cpu.get("stock_by_method_us", {})
    methods = [m for m in fix_methods(cpu, fix) if m in per]
    if not methods:
        return 0.0
    n = len(per[methods[0]])
    return median([sum(per[m][i] for m in methods) for i in range(n)])


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """Rows of {item, case, baseline, ext, ratio, target, met} as aligned text."""
    cols = ("item", "case", "stock/raw", "ext", "ratio", "target", "met?")
    keys = ("item", "case", "baseline", "ext", "ratio", "target", "met")
    cells = [[str(r.get(k, "")) for k in keys] for r in rows]
    width = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(width[i]) for i, c in enumerate(cols)),
           "  ".join("-" * w for w in width)]
    out += ["  ".join(row[i].ljust(width[i]) for i in range(len(cols))) for row in cells]
    return "\n".join(out)


def format_markdown(rows: Sequence[Dict[str, Any]]) -> str:
    keys = ("item", "case", "baseline", "ext", "ratio", "target", "met")
    out = ["| item | case | stock/raw | ext | ratio | target | met? |", "|---|---|---|---|---|---|---|"]
    out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(out)
