"""The figure users feel: time to first token and decode tokens/s through a real PD pair, -ext over stock.

    python -m bench.e2e [--pairs 31] [--backend mooncake]     (make bench-e2e)

Starts two 1P1D deployments side by side with ``launch-pd --device cpu`` on this machine
(SGLang's own servers and router, the tiny random model, Mooncake over TCP): one with the stock
backend name, one with its ``-ext`` name, and a colocated server is not needed. Then it sends the
same streamed greedy request to both, back to back, alternating which goes first
(``bench.stats.interleaved_order``), ``--pairs`` times after one warm-up round. Per request:
TTFT (seconds from sending to the first streamed token) and decode tokens/s (tokens after the
first over the seconds between the first and the last). Figures are medians of the per-pair
ratios ext/stock with quartiles; "no verdict" where the quartiles straddle the target (1.02 for
TTFT, 0.98 for tokens/s, whose ratio is better when higher). On a 2-core CPU machine the
absolute times are dominated by the model's CPU forward and the servers' scheduling, not the
transfer: the ratios say whether the plugin's path costs anything a user sees; absolute times
only mean something on a GPU.

Writes ``bench/results.json`` key ``e2e`` (every sample, so a unit test recomputes the figures)
and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# cpu_servers (test/support) imports its neighbours as ``support.*``: both folders on the path.
sys.path[:0] = [str(ROOT / "test" / "support"), str(ROOT / "test")]

from bench.stats import interleaved_order, paired_ratios  # noqa: E402

RESULTS = ROOT / "bench" / "results.json"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # 180 tokens: three chunks of 64
MAX_NEW_TOKENS = 32
TARGETS = {"ttft": ("<=", 1.02), "decode_tokens_per_s": (">=", 0.98)}


def streamed(url: str, timeout: float = 120.0):
    """(ttft_s, decode_tokens_per_s, tokens) of one streamed greedy request."""
    body = json.dumps({"text": PROMPT, "stream": True,
                       "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS,
                                           "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            now = time.perf_counter()
            ids = chunk.get("output_ids") or []
            n = chunk.get("meta_info", {}).get("completion_tokens", len(ids))
            if n and first is None:
                first = now
            if n:
                last, tokens = now, n
    if first is None or tokens < 2:
        raise RuntimeError(f"{url}: the stream carried {tokens} tokens")
    return first - t0, (tokens - 1) / max(last - first, 1e-9), tokens


def verdict(key: str, q: dict) -> str:
    op, target = TARGETS[key]
    good = (lambda x: x <= target) if op == "<=" else (lambda x: x >= target)
    if good(q["q1"]) and good(q["q3"]):
        return "met"
    if not good(q["q1"]) and not good(q["q3"]):
        return "not met"
    return "no verdict"


def main(argv=None) -> int:
    import cpu_servers as cs

    parser = argparse.ArgumentParser(prog="bench.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=31, help="back-to-back ext/stock pairs (default 31)")
    parser.add_argument("--backend", default="mooncake", choices=("mooncake",),
                        help="stock backend name; its -ext name runs beside it (Mooncake over TCP)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results.json alone")
    args = parser.parse_args(argv)
    if args.pairs < 3:
        parser.error("--pairs must be at least 3 (quartiles)")

    from sglang_disagg_ext import releases

    start = time.time()
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    model = work / "tiny"
    from sglang_disagg_ext.deploy.tiny_model import write_tiny_model

    write_tiny_model(model, with_weights=True)
    names = {"stock": args.backend, "ext": args.backend + "-ext"}
    pairs = {side: cs.PDPair(work / side, backend, str(model)) for side, backend in names.items()}
    try:
        cs.start_pairs(list(pairs.values()))
        urls = {side: p.router_url for side, p in pairs.items()}
        for side in urls:  # warm-up: first requests pay one-time costs on each server
            streamed(urls[side])
        samples = {side: {"ttft_s": [], "decode_tokens_per_s": []} for side in urls}
        for _, side in interleaved_order(list(urls), args.pairs):
            ttft, tps, _ = streamed(urls[side])
            samples[side]["ttft_s"].append(ttft)
            samples[side]["decode_tokens_per_s"].append(tps)
    finally:
        for p in pairs.values():
            p.stop()
    ttft = paired_ratios(samples["ext"]["ttft_s"], samples["stock"]["ttft_s"])
    tps = paired_ratios(samples["ext"]["decode_tokens_per_s"], samples["stock"]["decode_tokens_per_s"])
    result = {
        "sglang": releases.installed_sglang_version(),
        "backends": names,
        "pairs": args.pairs,
        "prompt_tokens": len(PROMPT) + 1,
        "max_new_tokens": MAX_NEW_TOKENS,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_average_start": [round(x, 2) for x in load_start],
                    "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "gpu": "none (CPU servers; absolute times mean nothing for a GPU deployment)",
        "ttft_ext_over_stock": {**ttft, "target": "<= 1.02", "verdict": verdict("ttft", ttft)},
        "decode_tokens_per_s_ext_over_stock": {**tps, "target": ">= 0.98", "verdict": verdict("decode_tokens_per_s", tps)},
        "samples": samples,
        "wall_seconds": round(time.time() - start, 1),
    }
    print(f"SGLang {result['sglang']}, {args.pairs} pairs, {MAX_NEW_TOKENS} tokens after a {result['prompt_tokens']}-token "
          f"prompt, load {result['machine']['load_average_start']} -> {result['machine']['load_average_end']}")
    print(f"{'figure':<36} {'median':>7} {'[q1-q3]':>15} {'target':>8}  verdict")
    for name, r in (("TTFT ext/stock", result["ttft_ext_over_stock"]),
                    ("decode tokens/s ext/stock", result["decode_tokens_per_s_ext_over_stock"])):
        print(f"{name:<36} {r['median']:>7.3f} [{r['q1']:.3f}-{r['q3']:.3f}] {r['target']:>8}  {r['verdict']}")
    for side in ("stock", "ext"):
        s = samples[side]
        print(f"  {names[side]:<13} TTFT median {sorted(s['ttft_s'])[len(s['ttft_s']) // 2] * 1000:.0f} ms, "
              f"decode {sorted(s['decode_tokens_per_s'])[len(s['decode_tokens_per_s']) // 2]:.1f} tokens/s")
    if not args.no_write:
        data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        data["e2e"] = result
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
        print(f"written to {RESULTS.relative_to(ROOT)} (key e2e)")
    return 0


def check_e2e(result: dict) -> None:
    """Recompute the e2e figures from their samples; raise ValueError naming one that does not match."""
    s = result["samples"]
    for key, name in (("ttft_ext_over_stock", "ttft_s"), ("decode_tokens_per_s_ext_over_stock", "decode_tokens_per_s")):
        if not (len(s["ext"][name]) == len(s["stock"][name]) == result["pairs"]):
            raise ValueError(f"{key}: {len(s['ext'][name])}/{len(s['stock'][name])} samples, pairs {result['pairs']}")
        want = paired_ratios(s["ext"][name], s["stock"][name])
        for q in ("median", "q1", "q3"):
            if abs(result[key][q] - want[q]) > 1e-9:
                raise ValueError(f"{key}: {q} {result[key][q]} is not {want[q]} from its samples")
        if result[key]["verdict"] != verdict(name.replace("_s", "") if name == "ttft_s" else name, want):
            raise ValueError(f"{key}: verdict {result[key]['verdict']!r} does not follow from its quartiles")


if __name__ == "__main__":
    sys.exit(main())
