"""How the transfer figures grow, as a PNG (matplotlib, no display).

Top row: what the README claims, as ratios with their quartiles: ext/stock transfer
time against tokens per request (with the verified transfers' cost over unverified
ones at the sizes measured) and against concurrency, on a linear axis around 1 with
the 1.02 target; and the state path against the raw engine. Bottom row: the CPU the plugin adds per
request (thread CPU time, engine excluded) against the same two axes, and as a
share of the transfer's time, with the 2 % target."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence


def growth_png(transfer_rows: Sequence[Dict[str, Any]], goodput_rows: Sequence[Dict[str, Any]], path: str,
               title: str, verified_rows: Sequence[Dict[str, Any]] = ()) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(16, 10))
    axes = grid[0]
    colors = {False: "tab:orange", True: "tab:red"}

    def ratios(rows: List[Dict[str, Any]], x_key: str, ax, x_label: str, offset: float) -> None:
        # Medians of paired ratios with their quartiles (the spread noise gives them), one
        # series per payload, nudged apart on x so overlapping bars stay readable.
        for with_state in (False, True):
            pts = sorted((r for r in rows if r["with_state"] == with_state), key=lambda r: r[x_key])
            if not pts:
                continue
            label = "ext/stock, " + ("KV + " + "+".join(pts[0]["state_components"]) if with_state else "KV only")
            shift = offset ** (1 if with_state else -1)
            xs = [r[x_key] * shift for r in pts]
            med = [r["ratio"] for r in pts]
            err = [[r["ratio"] - r["ratio_q1"] for r in pts], [r["ratio_q3"] - r["ratio"] for r in pts]]
            ax.errorbar(xs, med, yerr=err, color=colors[with_state], marker="s", capsize=3, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.02, color="gray", linestyle=":", label="target <= 1.02")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x_label)
        ax.grid(True, which="both", alpha=0.3)

    by_tokens = [r for r in transfer_rows if r["concurrency"] == 1]
    tokens_at = {r["tokens"] for r in transfer_rows if r["concurrency"] > 1}
    by_count = [r for r in transfer_rows if r["tokens"] in tokens_at]
    ratios(by_tokens, "tokens", axes[0], "tokens per request (1 request at a time)", 1.06)
    for r in verified_rows:
        if "ratio_q1" not in r:
            continue
        axes[0].errorbar([r["tokens"] * (1.06 if r["with_state"] else 1 / 1.06)], [r["ratio"]], yerr=[[r["ratio"] - r["ratio_q1"]], [r["ratio_q3"] - r["ratio"]]],
                         color="tab:purple", marker="D" if r["with_state"] else "o", capsize=3, linestyle="none",
                         label=f"verified/unverified ext, {'KV + state' if r['with_state'] else 'KV only'}")
    if verified_rows:
        axes[0].axhline(1.10, color="tab:purple", linestyle=":", label="verified target <= 1.10")
    axes[0].set_ylabel("time ratio per request: median [quartiles]")
    axes[0].set_title("ext over stock (and verified over unverified) vs tokens")
    axes[0].legend(fontsize=8)
    ratios(by_count, "concurrency", axes[1], f"concurrent requests ({', '.join(map(str, sorted(tokens_at)))} tokens each)",
           1.06)
    axes[1].set_ylabel("time ratio per request: median [quartiles]")
    axes[1].set_title("ext over stock vs request count")
    axes[1].legend(fontsize=8)

    ax = axes[2]
    pts = sorted(goodput_rows, key=lambda r: r["bytes"])
    if pts:
        mib = [r["bytes"] / 2**20 for r in pts]
        for key, label, color in (("ext_s", "ext state path", "tab:red"), ("raw_s", "raw engine, same list", "tab:blue"),
                                  ("raw_per_page_s", "raw engine, one descriptor per page", "tab:gray")):
            ax.plot(mib, [r[key] * 1e3 for r in pts], marker="o", color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    ax.set_xlabel("state bytes per request [MiB]")
    ax.set_ylabel("state transfer time [ms] (median)")
    ax.set_title("state path vs raw engine")
    _cpu_panels(transfer_rows, grid[1])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cpu_panels(transfer_rows: Sequence[Dict[str, Any]], axes) -> None:
    import statistics

    rows = [r for r in transfer_rows if "cpu" in r]
    by_tokens = [r for r in rows if r["concurrency"] == 1]
    tokens_at = {r["tokens"] for r in rows if r["concurrency"] > 1}
    by_count = [r for r in rows if r["tokens"] in tokens_at]
    colors = {False: "tab:orange", True: "tab:red"}

    def added(r):
        return statistics.median(r["cpu"]["added_us"])

    def fraction(r):
        return 100 * added(r) / (min(r["samples_s"]["stock"]) * 1e6)

    panels = ((axes[0], by_tokens, "tokens", added, "tokens per request (1 request at a time)",
               "added CPU per request [us] (median)", "plugin CPU vs tokens per request"),
              (axes[1], by_count, "concurrency", added,
               f"concurrent requests ({', '.join(map(str, sorted(tokens_at)))} tokens each)",
               "added CPU per request [us] (median)", "plugin CPU vs request count"),
              (axes[2], by_tokens, "tokens", fraction, "tokens per request (1 request at a time)",
               "added CPU / transfer time [%]", "plugin CPU as share of the transfer"))
    for ax, pts_all, x_key, y, x_label, y_label, title in panels:
        for with_state in (False, True):
            pts = sorted((r for r in pts_all if r["with_state"] == with_state), key=lambda r: r[x_key])
            if pts:
                label = "KV + " + "+".join(pts[0]["state_components"]) if with_state else "KV only"
                ax.plot([r[x_key] for r in pts], [y(r) for r in pts], marker="s", color=colors[with_state],
                        label=label)
        if y is fraction:
            ax.axhline(2.0, color="gray", linestyle=":", label="target 2 % (at 8K tokens)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)


def main(argv=None) -> int:
    """Draw the PNG again from a results file (no benchmark run): ``python -m bench.plot [results.json] [out.png]``."""
    import json
    import os
    import sys

    args = sys.argv[1:] if argv is None else argv
    here = os.path.dirname(os.path.abspath(__file__))
    src = args[0] if args else os.path.join(here, "results.json")
    dst = args[1] if len(args) > 1 else os.path.join(here, "growth.png")
    with open(src) as f:
        out = json.load(f)
    growth_png(out["details"]["transfer"], out["details"]["goodput"], dst, title_of(out),
               out["details"].get("verified") or ())
    print(dst)
    return 0


def title_of(out: Dict[str, Any]) -> str:
    m = out["machine"]
    return (f"sglang-disagg-ext transfer figures, SGLang {out['sglang']}, Mooncake TCP loopback, CPU pools; "
            f"{m['cores']} cores {m['cpu']}; medians of interleaved pairs, bars: quartiles")


if __name__ == "__main__":
    raise SystemExit(main())
