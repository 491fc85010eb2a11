"""``bench/results.json``: schema, verdicts and the printed table. Pure.

Required keys (issue #8): ``ext_over_stock``, ``goodput_over_raw``,
``slice_build_over_stock``, ``offload_over_copy`` -- each a non-empty list of
``{"case": str, "ratio": positive finite float}`` -- and ``plugin_load_ms``
(a finite number). Everything else (machine, units, per-case details) rides
along under other keys.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

RATIO_KEYS = ("ext_over_stock", "goodput_over_raw", "slice_build_over_stock", "offload_over_copy")
REQUIRED_KEYS = RATIO_KEYS + ("plugin_load_ms",)

# (bound, "max" | "min"): a ratio meets the target when <= (max) or >= (min) it.
TARGETS: Dict[str, Optional[tuple]] = {
    "ext_over_stock": (1.02, "max"),
    "goodput_over_raw": (0.9, "min"),
    "slice_build_over_stock": (1.0, "max"),
    "offload_over_copy": None,  # the issue sets none: reported, not judged
}


def verdict(key: str, ratio: float, q1: Optional[float] = None, q3: Optional[float] = None) -> str:
    """"yes" / "no" against the key's target; "noise" when the median misses it
    but the target lies inside the paired ratios' interquartile range; "-"
    where there is no target."""
    target = TARGETS[key]
    if target is None:
        return "-"
    bound, kind = target
    if (ratio <= bound) if kind == "max" else (ratio >= bound):
        return "yes"
    if q1 is not None and q3 is not None and q1 <= bound <= q3:
        return "noise"
    return "no"


def target_text(key: str) -> str:
    target = TARGETS[key]
    if target is None:
        return "-"
    bound, kind = target
    return f"<= {bound:g}" if kind == "max" else f">= {bound:g}"


def ratio_list(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The ``[{"case", "ratio"}]`` list of the schema from detail rows."""
    return [{"case": str(r["case"]), "ratio": float(r["ratio"])} for r in rows]


def validate(results: Dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first thing that does not fit the schema."""
    if not isinstance(results, dict):
        raise ValueError(f"results must be a JSON object, got {type(results).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in results]
    if missing:
        raise ValueError(f"results lack key(s) {missing}")
    for key in RATIO_KEYS:
        rows = results[key]
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
