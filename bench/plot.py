"""How the transfer figures grow, as a PNG (matplotlib, no display).

Top row: transfer time against tokens per request and against concurrency, and
the state path against the raw engine. Bottom row: the CPU the plugin adds per
request (thread CPU time, engine excluded) against the same two axes, and as a
share of the transfer's time, with the 2 % target."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence


def growth_png(transfer_rows: Sequence[Dict[str, Any]], goodput_rows: Sequence[Dict[str, Any]], path: str,
               title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(16, 10))
    axes = grid[0]
    styles = {("stock", False): ("tab:blue", "o", "-"), ("ext", False): ("tab:orange", "s", "--"),
              ("stock", True): ("tab:green", "o", "-"), ("ext", True): ("tab:red", "s", "--")}

    def series(rows: List[Dict[str, Any]], x_key: str, ax, x_label: str) -> None:
        for with_state in (False, True):
            pts = sorted((r for r in rows if r["with_state"] == with_state), key=lambda r: r[x_key])
            if not pts:
                continue
            label_state = "KV + " + "+".join(pts[0]["state_components"]) if with_state else "KV only"
            for variant in ("stock", "ext"):
                color, marker, line = styles[(variant, with_state)]
                ax.plot([r[x_key] for r in pts], [r[f"{variant}_s"] * 1e3 for r in pts], color=color,
                        marker=marker, linestyle=line, label=f"{variant}, {label_state}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x_label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    by_tokens = [r for r in transfer_rows if r["concurrency"] == 1]
    tokens_at = {r["tokens"] for r in transfer_rows if r["concurrency"] > 1}
    by_count = [r for r in transfer_rows if r["tokens"] in tokens_at]
    series(by_tokens, "tokens", axes[0], "tokens per request (1 request at a time)")
    axes[0].set_ylabel("transfer time per request [ms] (median)")
    axes[0].set_title("time vs tokens per request")
    series(by_count, "concurrency", axes[1], f"concurrent requests ({', '.join(map(str, sorted(tokens_at)))} tokens each)")
    axes[1].set_ylabel("batch time / requests [ms] (median)")
    axes[1].set_title("time vs request count")

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
