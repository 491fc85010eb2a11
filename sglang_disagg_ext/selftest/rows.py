"""Rows of the ``selftest`` table: one builder for every fix family, progress, totals.

A row says how one scenario went with the stock backend name and with the
``-ext`` name: ``stock``/``ext`` are "pass", "fail" or "n/a". "n/a" means the
scenario was not run here, and ``why`` says why (the fix does not exist on this
release, the engine or a stand-in is missing, the options do not apply); such
a row is never counted as passed.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Dict, List, Optional

COLUMNS = ("scenario", "fix", "backend", "stock", "ext", "verified", "seconds")

# Switched on by the CLI for the length of one run: one line on stderr per finished row, so a
# run of minutes talks. A flag, not a stream: the line goes to the ``sys.stderr`` of the moment,
# so a stream replaced or closed since (pytest's capture of an earlier test) is never written.
_progress = False


@contextlib.contextmanager
def progress_on_stderr():
    """One progress line per finished row while inside; off again after, whatever happens."""
    global _progress
    before, _progress = _progress, True
    try:
        yield
    finally:
        _progress = before


def make_row(scenario: str, fix: str, backend: str, stock: str, ext: str, verified: bool, seconds: float,
             why: Optional[str] = None, **extra) -> Dict:
    """One row. ``why``: the reason an "n/a" row was not run (required for those)."""
    if ext == "n/a" and not why:
        why = extra.get("detail") or extra.get("note") or extra.get("ext_detail") or "not applicable here"
    row = {
        "scenario": scenario,
        "fix": fix,
        "backend": backend,
        "stock": stock,
        "ext": ext,
        "verified": bool(verified),
        "seconds": round(float(seconds), 2),
    }
    if ext == "n/a":
        row["not_run"] = why
    row.update(extra)
    if _progress:
        tail = f" (not run: {why})" if ext == "n/a" else ""
        print(
            f"[selftest] {fix} {backend} {scenario!r}: stock {stock}, ext {ext}, {row['seconds']:.1f}s{tail}",
            file=sys.stderr, flush=True,
        )
    return row


def totals(rows: List[Dict]) -> Dict:
    """Counts by outcome of the ``-ext`` runs; "n/a" rows count as not run, never as passed."""
    ran = [r for r in rows if r["ext"] != "n/a"]
    failed = [r for r in ran if r["ext"] != "pass"]
    return {
        "rows": len(rows),
        "ran": len(ran),
        "passed": len(ran) - len(failed),
        "failed": len(failed),
        "not_run": len(rows) - len(ran),
        "not_run_rows": {r["scenario"]: r.get("not_run") for r in rows if r["ext"] == "n/a"},
    }


def format_table(rows: List[Dict]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in COLUMNS} if rows else {
        c: len(c) for c in COLUMNS
    }
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines.append("  ".join("-" * widths[c] for c in COLUMNS))
    for r in rows:
        lines.append("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in COLUMNS))
    return "\n".join(lines)


def summary_line(t: Dict) -> str:
    line = f"{t['passed']} of {t['ran']} -ext scenarios run here passed"
    if t["failed"]:
        line += f", {t['failed']} failed"
    if t["not_run"]:
        line += f"; {t['not_run']} not run (n/a here, reasons above)"
    return line
