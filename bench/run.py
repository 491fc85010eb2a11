"""``make bench``: every figure of issue #8 in one run, as ratios measured side by side.

    python -m bench.run            # full run (about 10-15 minutes on 2 shared cores)
    python -m bench.run --quick    # tiny sizes, a smoke run (about 2 minutes)

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


def _row(item: str, key: str, r: Dict[str, Any], baseline: str, ext: str, case: Optional[str] = None) -> Dict:
    return {"item": item, "case": case or r["case"], "baseline": baseline, "ext": ext, "ratio": _ratio_text(r),
            "target": res.target_text(key), "met": res.verdict(key, r["ratio"], r.get("ratio_q1"), r.get("ratio_q3"))}


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
        "units": {"ratio": "dimensionless", "*_s": "seconds", "*_ms": "milliseconds", "*_GBps": "1e9 bytes/s",
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

    transfer, goodput = [], []
    with TransferBench(plan, per_component, max_seconds=args.max_seconds) as tb:
        log(f"transfer workers up ({time.monotonic() - started:.0f} s): {tb.info['prefill']['managers']}")
        for case in plan.cases():
            r = tb.run_case(case, plan.repeats)
            transfer.append(r)
            log(f"  1 {r['case']}: stock {_ms(r['stock_s'])} ext {_ms(r['ext_s'])} ratio {_ratio_text(r)}")
        for pages in plan.goodput_pages:
            r = tb.goodput(pages, plan.goodput_repeats)
            goodput.append(r)
            log(f"  2 {r['case']}: ext {r['ext_GBps']:.2f} GB/s raw {r['raw_GBps']:.2f} GB/s ratio {_ratio_text(r)}")
    out["details"]["transfer"] = transfer
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
    for r in goodput:
        d = r["descriptors"]
        rows.append(_row("2 goodput", "goodput_over_raw", r, f"{r['raw_GBps']:.2f} GB/s, {d['raw']} desc",
                         f"{r['ext_GBps']:.2f} GB/s, {d['ext']} desc",
                         case=f"{r['case']} ({r['bytes'] / 2**20:.1f} MiB; per-page {d['raw_per_page']} desc)"))

    # Item 3: head-slice descriptors, stock vs ext, same inputs.
    from bench import head_slice

    slices = []
    for case in head_slice.default_cases(quick=args.quick):
        r = head_slice.measure(case, repeats=2 if args.quick else 7)
        slices.append(r)
        log(f"  3 {r['case']}: stock {_ms(r['stock_s'])} ext {_ms(r['ext_s'])} ({r['descriptors']} desc)")
        rows.append(_row("3 head slice", "slice_build_over_stock", r, _ms(r["stock_s"]), _ms(r["ext_s"]),
                         case=f"{r['case']}, {r['descriptors']} desc"))
    out["details"]["head_slice"] = slices

    # Item 4: NSA index-key offload/restore vs a plain copy (bench.offload).
    from bench import offload

    devices = ["cpu"] + (["cuda"] if _gpu() else [])
    cases = offload.DEFAULT_CASES[:1] if args.quick else offload.DEFAULT_CASES
    off = []
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
    out["slice_build_over_stock"] = res.ratio_list(slices)
    out["offload_over_copy"] = res.ratio_list(off)
    out["load_average_end"] = _load()
    out["wall_seconds"] = round(time.monotonic() - started, 1)
    out["table"] = rows
    if not _gpu():
        out["gpu_rows"] = NO_GPU
    res.validate(out)
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

    policy = releases.current_policy()
    if not policy.is_live("F5"):
        # Items 3-4 measure F4/F5 code and items 1-2 the -ext transfer path as it is
        # on releases with F1-F5; where those are upstream (0.5.13+) there is no such
        # code to compare with stock.
        print(f"bench: SGLang {policy.version} ({policy.support.value}) already has the fixes this bench measures "
              f"(F1-F5 upstream); there is nothing to compare. Run it on a release with F1-F5 live, e.g. "
              f"make bench SGLANG=0.5.12.post1", file=sys.stderr)
        return 2
    out = run(args)
    with open(args.out + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    if args.png:
        from bench.plot import growth_png

        m = out["machine"]
        growth_png(out["details"]["transfer"], out["details"]["goodput"], args.png,
                   f"sglang-disagg-ext transfer figures, SGLang {out['sglang']}, Mooncake TCP loopback, CPU pools; "
                   f"{m['cores']} cores {m['cpu']}; medians of interleaved repeats")
    m = out["machine"]
    print()
    print(res.format_table(out["table"]))
    print(f"\nmachine: {m['cores']} cores, {m['cpu']}, {m['memory_gib']} GiB; load average "
          f"{out['load_average_start']} at start, {out['load_average_end']} at end; SGLang {out['sglang']}; "
          f"{out['wall_seconds']:.0f} s")
    print(out.get("gpu_rows") or f"GPU: {out['gpu']} (offload rows marked [GPU]; items 1-2 run on CPU pools)")
    print(f"ratio: median over interleaved back-to-back pairs [lower-upper quartile]; met? 'noise' = the target "
          f"lies within that range. Wrote {args.out}" + (f" and {args.png}" if args.png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
