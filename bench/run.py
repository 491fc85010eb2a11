"""``make bench``: every figure of issues #8 and #18 in one run, measured side by side.

    python -m bench.run            # full run (about 30-40 minutes on 2 shared cores: 31 pairs a case)
    python -m bench.run --quick    # tiny sizes, 3 pairs a case, a smoke run (about 1 minute)

Items 1, 2, 6 and 7 (the Mooncake transfer path) run on every release where
``mooncake-ext`` has a live fix; items 3 and 4 measure F4 / F5 code and say
``n/a: upstream on this release`` where those fixes are upstream (0.5.13+).

Item 8: verified/unverified ``mooncake-ext`` transfer time, end to end
(prefill's send until decode saw Success, decode's digest check included), where
``verification.available`` says verification works; "n/a: <why>" elsewhere.

Prints one table (item, case, stock/raw, ext, ratio, target, met?) and the
machine (cores, CPU model, load average at start and end), writes
``bench/results.json`` (schema: ``bench.results``) and ``bench/growth.png``.
Method and shapes: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional

from bench import results as res
from bench import shapes
from bench.stats import median

HERE = os.path.dirname(os.path.abspath(__file__))
NO_GPU = "GPU rows: not measured, no GPU"


def machine_info() -> Dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": model, "memory_gib": mem_gib, "python": platform.python_version(),
            "kernel": platform.release()}


def _load() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _gpu() -> Optional[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no usable torch CUDA means no GPU rows
        return None
    return None


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _ratio_text(r: Dict[str, Any]) -> str:
    if "ratio_q1" in r:
        return f"{r['ratio']:.3f} [{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}]"
    return f"{r['ratio']:.3f}"


def _read_floor(r: Dict[str, Any]) -> Dict[str, Any]:
    """Item 8's read-floor ratio (read/unverified) of a verified case, as ``_ratio_text`` takes it."""
    return {"ratio": r["read_ratio"], "ratio_q1": r["read_ratio_q1"], "ratio_q3": r["read_ratio_q3"]}


def _row(item: str, key: str, r: Dict[str, Any], baseline: str, ext: str, case: Optional[str] = None) -> Dict:
    return {"item": item, "case": case or r["case"], "baseline": baseline, "ext": ext, "ratio": _ratio_text(r),
            "target": res.target_text(key), "met": res.verdict(key, r["ratio"], r.get("ratio_q1"), r.get("ratio_q3"))}


def _na_row(item: str, why: str = res.NA_UPSTREAM) -> Dict:
    return {"item": item, "case": "-", "baseline": "-", "ext": "-", "ratio": why, "target": "-", "met": "-"}


# Fixes of the newest releases whose cost item 7 reports, with what they do per request.
FIX_TITLES = {"F6": "bounds check of decode indices", "F7": "state layer pairing",
              "F9": "registration refusal check", "base": "state-failure plumbing (send_aux)"}


def cpu_rows(transfer: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``ext_cpu_overhead``: per case, the median added CPU per request (us), the fastest stock
    per-request transfer time of the case's pairs (us; the least load-inflated, so the fraction
    is the largest the samples allow) and added / transfer."""
    out = []
    for r in transfer:
        added = median(r["cpu"]["added_us"])
        t = min(r["samples_s"]["stock"]) * 1e6
        out.append({"case": r["case"], "added_cpu_us": added, "transfer_us": t, "fraction": added / t})
    return out


def fix_rows(transfer: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``fix_cpu_overhead``: per case and fix with frames on this release, that fix's own CPU per
    request, the stock CPU of the methods it stands in front of (stock manager, same transfer)."""
    out = []
    for r in transfer:
        t = min(r["samples_s"]["stock"]) * 1e6
        for fix, samples in sorted(r["cpu"]["by_fix_us"].items()):
            added = median(samples)
            out.append({"case": r["case"], "fix": fix, "added_cpu_us": added,
                        "stock_cpu_us": res.fix_stock_cpu(r["cpu"], fix), "transfer_us": t, "fraction": added / t})
    return out


def run(args) -> Dict[str, Any]:
    import torch

    from sglang_disagg_ext import releases

    torch.set_num_threads(1)  # as the offload figures were taken; the workers set OMP_NUM_THREADS=1 too
    plan = shapes.QUICK if args.quick else shapes.FULL
    version = releases.installed_sglang_version()
    policy = releases.current_policy()
    per_component = policy.layout is not releases.StateLayout.FLAT
    started = time.monotonic()
    out: Dict[str, Any] = {
        "sglang": version,
        "plugin_support": policy.support.value,
        "quick": bool(args.quick),
        "machine": machine_info(),
        "load_average_start": _load(),
        "gpu": _gpu() or NO_GPU,
        "units": {"ratio": "dimensionless", "fraction": "dimensionless", "*_s": "seconds", "*_ms": "milliseconds",
                  "*_us": "microseconds (CPU: thread CPU time per request)", "*_GBps": "1e9 bytes/s",
                  "bytes*": "bytes", "plugin_load_ms": "milliseconds added to load_plugins() (server process)"},
        "targets": {k: res.target_text(k) for k in res.RATIO_KEYS},
        "details": {},
    }
    log = print if not args.quiet else (lambda *a, **k: None)
    log(f"SGLang {version} ({policy.support.value}, {'per-component' if per_component else 'flat'} state layout); "
        f"{out['machine']['cores']} cores, {out['machine']['cpu']}; load {out['load_average_start']}")
    rows: List[Dict[str, Any]] = []

    # Items 1 and 2: real SGLang managers over real Mooncake TCP on loopback.
    from bench.transfer import TransferBench

    from sglang_disagg_ext import verification

    # Item 8: verified/unverified, where verification works on this release.
    verify_why = verification.available(policy).get("mooncake-ext", "")
    transfer, goodput, verified = [], [], []
    with TransferBench(plan, per_component, max_seconds=args.max_seconds, verified=not verify_why) as tb:
        log(f"transfer workers up ({time.monotonic() - started:.0f} s): {tb.info['prefill']['managers']}")
        for case in plan.cases():
            r = tb.run_case(case, plan.repeats, plan.cpu_repeats)
            transfer.append(r)
            c = r["cpu"]
            log(f"  1 {r['case']}: stock {_ms(r['stock_s'])} ext {_ms(r['ext_s'])} ratio {_ratio_text(r)}; "
                f"added CPU {median(c['added_us']):.1f} us/req, engine calls "
                f"{'identical' if c['engine_calls_identical'] else 'DIFFER'}")
        for pages in plan.goodput_pages:
            r = tb.goodput(pages, plan.goodput_repeats)
            goodput.append(r)
            log(f"  2 {r['case']}: ext {r['ext_GBps']:.2f} GB/s raw {r['raw_GBps']:.2f} GB/s ratio {_ratio_text(r)}")
        for case in ([] if verify_why else plan.verify_cases()):
            r = tb.verify_case(case, plan.repeats)
            verified.append(r)
            log(f"  8 {r['case']}: ext {_ms(r['ext_s'])} verified {_ms(r['verified_s'])} ratio {_ratio_text(r)}; "
                f"read floor {_ms(r['read_s'])} ratio {_ratio_text(_read_floor(r))}, verified/read "
                f"{r['verified_over_read']:.3f}")
    out["details"]["transfer"] = transfer
    out["details"]["cpu_method"] = {
        "clock": "time.thread_time_ns per thread, exclusive per frame (a frame's calls into other traced frames "
                 "are charged to those), summed over the prefill worker's threads",
        "added": "frames of the plugin's classes on the ext manager: every per-request method they override "
                 "(details.transfer[].cpu.traced_labels.plugin); stock's methods and the engine's transfer calls "
                 "are their own frames, so excluded",
        "not_traced": "F8's per-chunk queue/socket wrappers (one attribute write per chunk or message)",
        "samples": "traced pairs run after the wall-clock pairs; tracing is never on in a timed pair",
        "tracer_ns_per_frame": tb.info["prefill"].get("tracer_ns_per_frame"),
        "transfer_us": "the fastest stock per-request transfer time among the case's wall-clock pairs",
    }
    out["details"]["goodput"] = goodput
    out["details"]["transfer_shapes"] = {
        "page_size": shapes.PAGE_SIZE, "kv": f"{shapes.KV_LAYERS} layers x K,V x {shapes.KV_HEADS} head x "
        f"{shapes.KV_HEAD_DIM} dims {shapes.DTYPE}", "kv_bytes_per_token": shapes.kv_page_bytes() // shapes.PAGE_SIZE,
        "state_components": [dict(kind=c.kind, layers=c.layers, head_dim=c.head_dim, window_tokens=c.window_tokens)
                             for c in shapes.state_components(per_component)],
        "pool_pages": plan.pool_pages(), "max_run_pages": shapes.MAX_RUN_PAGES, "transport": "Mooncake TCP, 127.0.0.1",
    }
    for r in transfer:
        rows.append(_row("1 ext/stock", "ext_over_stock", r, _ms(r["stock_s"]), _ms(r["ext_s"])))
    if verify_why:
        rows.append(_na_row("8 verified", f"n/a: {verify_why}"))
    for r in verified:
        rows.append(_row("8 verified", "verified_over_unverified", r, _ms(r["ext_s"]), _ms(r["verified_s"])))
        # No target: what reading the same pages once more costs here, the least a check can.
        rows.append({"item": "8 read floor", "case": r["case"], "baseline": _ms(r["ext_s"]), "ext": _ms(r["read_s"]),
                     "ratio": _ratio_text(_read_floor(r)), "target": "-",
                     "met": f"verified/read {r['verified_over_read']:.3f}"})
    out["details"]["verified"] = verified
    for r in goodput:
        d = r["descriptors"]
        rows.append(_row("2 goodput", "goodput_over_raw", r, f"{r['raw_GBps']:.2f} GB/s, {d['raw']} desc",
                         f"{r['ext_GBps']:.2f} GB/s, {d['ext']} desc",
                         case=f"{r['case']} ({r['bytes'] / 2**20:.1f} MiB; per-page {d['raw_per_page']} desc)"))

    # Items 6 and 7: the CPU the -ext send path adds per request (engine excluded), next to the
    # transfer's time; per fix of this release against stock's methods on the same transfer.
    cpu = cpu_rows(transfer)
    fixes = fix_rows(transfer)
    by_case = {r["case"]: r for r in transfer}
    for row in cpu:
        d = by_case[row["case"]]
        e = d["cpu"]["engine_calls"]
        same = "same" if d["cpu"]["engine_calls_identical"] else "DIFFERENT"
        judged = d["tokens"] == res.CPU_TARGET_TOKENS and d["concurrency"] == 1
        rows.append({"item": "6 added CPU", "case": row["case"],
                     "baseline": f"{row['transfer_us']:.0f} us transfer; {e['stock']['descriptors']} desc",
                     "ext": f"+{row['added_cpu_us']:.1f} us CPU; {e['ext']['descriptors']} desc, {same}",
                     "ratio": f"{row['fraction'] * 100:.3f}%",
                     "target": f"<= {res.CPU_TARGET * 100:g}%" if judged else "-",
                     "met": res.cpu_verdict(d["tokens"], d["concurrency"], row["fraction"])})
    shown = [c.name for c in plan.cases() if c.tokens == res.CPU_TARGET_TOKENS and c.concurrency == 1]
    for fix in ("F6", "F7"):
        if not policy.is_live(fix):
            rows.append(_na_row(f"7 {fix} cost", f"n/a: {fix} not in this release"))
    for row in fixes:
        if row["case"] not in shown:
            continue
        methods = "+".join(res.fix_methods(by_case[row["case"]]["cpu"], row["fix"]))
        rows.append({"item": f"7 {row['fix']} cost", "case": f"{row['case']}: {FIX_TITLES.get(row['fix'], '')}",
                     "baseline": f"stock {methods} {row['stock_cpu_us']:.1f} us CPU",
                     "ext": f"+{row['added_cpu_us']:.1f} us CPU", "ratio": f"{row['fraction'] * 100:.3f}%",
                     "target": "-", "met": "-"})
    out["ext_cpu_overhead"] = cpu
    out["fix_cpu_overhead"] = fixes

    # Item 3: head-slice descriptors, stock vs ext, same inputs (F4 code).
    from bench import head_slice

    slices = [] if policy.is_live("F4") else None
    if slices is None:
        rows.append(_na_row("3 head slice"))
    for case in head_slice.default_cases(quick=args.quick) if slices is not None else []:
        r = head_slice.measure(case, repeats=2 if args.quick else 7)
        slices.append(r)
        log(f"  3 {r['case']}: stock {_ms(r['stock_s'])} ext {_ms(r['ext_s'])} ({r['descriptors']} desc)")
        rows.append(_row("3 head slice", "slice_build_over_stock", r, _ms(r["stock_s"]), _ms(r["ext_s"]),
                         case=f"{r['case']}, {r['descriptors']} desc"))
    out["details"]["head_slice"] = slices

    # Item 4: NSA index-key offload/restore vs a plain copy (bench.offload, F5 code).
    off = [] if policy.is_live("F5") else None
    if off is None:
        rows.append(_na_row("4 offload"))
        devices, cases = [], []
    else:
        from bench import offload

        devices = ["cpu"] + (["cuda"] if _gpu() else [])
        cases = offload.DEFAULT_CASES[:1] if args.quick else offload.DEFAULT_CASES
    for device in devices:
        for case in cases:
            if args.quick:
                r = offload.measure_offload(layer_num=2, num_pages=64, request_pages=32, repeats=2,
                                            device=device, chunk_tokens=case["chunk_tokens"], scattered=True)
            else:
                r = offload.measure_offload(layer_num=8, repeats=11, device=device, **case)
            r["case"] = (f"{r['request_pages']} pages{' scattered' if r['scattered'] else ''}, "
                         f"chunk {r['chunk_pages']}p{' [GPU]' if device != 'cpu' else ''}")
            off.append(r)
            log(f"  4 {r['case']}: ext {r['ext_GBps']:.2f} GB/s plain {r['plain_GBps']:.2f} GB/s "
                f"peak extra {r['peak_extra_bytes'] / 1024:.0f} KiB")
            rows.append(_row("4 offload", "offload_over_copy", r, f"{r['plain_GBps']:.2f} GB/s",
                             f"{r['ext_GBps']:.2f} GB/s",
                             case=f"{r['case']}, peak +{r['peak_extra_bytes'] / 1024:.0f} KiB "
                                  f"(1 chunk {r['one_chunk_bytes'] / 1024:.0f} KiB)"))
    out["details"]["offload"] = off

    # Item 5: plugin loading.
    from bench import startup

    # A scheduler probe imports SGLang's memory pools (30-40 s on a loaded 2-core box): 2 repeats.
    load = startup.measure({"server": 1} if args.quick else {"server": 4, "scheduler": 2})
    for r in load:
        log(f"  5 {r['case']}: +{r['added_ms']:.1f} ms")
        rows.append({"item": "5 plugin load", "case": f"{r['case']} process", "baseline": f"{r['stock_ms']:.1f} ms",
                     "ext": f"{r['ext_ms']:.1f} ms", "ratio": f"+{r['added_ms']:.1f} ms", "target": "-",
                     "met": "-"})
    out["plugin_load_ms"] = next(r["added_ms"] for r in load if r["case"] == "server")
    out["plugin_load_ms_by_process"] = {r["case"]: r["added_ms"] for r in load}
    out["details"]["plugin_load"] = load

    out["ext_over_stock"] = res.ratio_list(transfer)
    out["goodput_over_raw"] = res.ratio_list(goodput)
    out[res.VERIFY_KEY] = res.ratio_list(verified) if verified else f"n/a: {verify_why}"
    out["slice_build_over_stock"] = res.ratio_list(slices) if slices is not None else res.NA_UPSTREAM
    out["offload_over_copy"] = res.ratio_list(off) if off is not None else res.NA_UPSTREAM
    out["load_average_end"] = _load()
    out["wall_seconds"] = round(time.monotonic() - started, 1)
    out["table"] = rows
    if not _gpu():
        out["gpu_rows"] = NO_GPU
    out["fixes_live"] = [f for f in releases.FIXES if policy.is_live(f)]
    res.validate(out)
    res.check_samples(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes and 1-2 repeats (smoke run)")
    ap.add_argument("--out", default=os.path.join(HERE, "results.json"))
    ap.add_argument("--png", default=os.path.join(HERE, "growth.png"), help="growth plot ('' for none)")
    ap.add_argument("--max-seconds", type=float, default=1800.0, help="lifetime bound of the transfer workers")
    ap.add_argument("--quiet", action="store_true", help="only the final table")
    args = ap.parse_args(argv)
    from sglang_disagg_ext import releases

    from sglang_disagg_ext.backends.mooncake.conn import ext_classes

    policy = releases.current_policy()
    if not ext_classes(policy):
        # Items 1, 2, 6, 7 compare the -ext Mooncake manager with stock's: where
        # mooncake-ext is a pure pass-through there is nothing to compare.
        print(f"bench: SGLang {policy.version} ({policy.support.value}): mooncake-ext is a pass-through here "
              f"(no fix of it is live); there is nothing to compare. Run it on a release with a live fix, e.g. "
              f"make bench SGLANG=0.5.23", file=sys.stderr)
        return 2
    out = run(args)
    with open(args.out + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    if args.png:
        from bench.plot import growth_png, title_of

        growth_png(out["details"]["transfer"], out["details"]["goodput"], args.png, title_of(out),
                   out["details"].get("verified") or ())
    m = out["machine"]
    print()
    print(res.format_table(out["table"]))
    print(f"\nmachine: {m['cores']} cores, {m['cpu']}, {m['memory_gib']} GiB; load average "
          f"{out['load_average_start']} at start, {out['load_average_end']} at end; SGLang {out['sglang']}; "
          f"{out['wall_seconds']:.0f} s")
    print(out.get("gpu_rows") or f"GPU: {out['gpu']} (offload rows marked [GPU]; items 1-2 run on CPU pools)")
    print(f"ratio: median over interleaved back-to-back pairs [lower-upper quartile]; met? 'no verdict' = the "
          f"target lies within that range. Item 6: thread CPU time of the plugin's frames on the prefill send "
          f"path per request (median of {out['details']['transfer'][0]['cpu_repeats']} traced pairs; stock and "
          f"engine frames excluded) over the fastest stock per-request transfer time; 'same' = stock and ext handed "
          f"the engine identical (buffer, offset, length) lists. Wrote {args.out}"
          + (f" and {args.png}" if args.png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
