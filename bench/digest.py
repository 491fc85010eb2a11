"""Verified transfers: what the digest costs next to moving the same bytes.

A benchmark, not a test. For the KV pages of one request of ``--tokens`` tokens in
the bench's shapes (``bench.shapes``: 4 layers, K and V buffers, 64-token pages,
1 head x 64 dims bf16), on CPU pools (or ``--device cuda``), it times, interleaved
and per sample in thread CPU time (wall time on CUDA, after a synchronize, and
with ``--threads`` above 1):

* **digest**: ``digest_kernels.rows_digests`` over every page of every buffer in one
  call, the pages gathered out of the pool by index inside it (decode's path before
  Success, and prefill's for a chunk whose pages are not one contiguous run; a
  contiguous run is digested in place, without the gather); on a device the buffers'
  totals come back to the host in one copy;
* **digest_each** (device only): the same, one ``rows_digest`` call (one copy back, so
  one synchronisation) per buffer, as the verified path did before;
* **digest_torch** (device only): ``rows_digests`` with the fused Triton kernel switched off
  (three torch kernels per buffer), as where Triton cannot be imported;
* **gather**: ``index_select`` of the same pages into a preallocated tensor (one
  read and one write of the bytes: what a transfer's source side costs at least).

It prints the medians, digest/gather, and the digest's share of a measured
transfer time when ``--transfer-ms`` is given (e.g. the 8K-token KV case of
``make bench``: ``details.transfer[].ext_ms``). Verification runs the digest twice
per request (prefill, decode), on two machines' CPUs in a real deployment.

    python -m bench.digest                       # 8K tokens, CPU
    python -m bench.digest --tokens 32768 --transfer-ms 17.9
    python -m bench.digest --slices              # head slices: batched vs one call per slice
    python -m bench.digest --max-run 8           # pages in short ascending runs (gathered or not)
    python -m bench.digest --threads 2           # torch threads (the CPU digest is numpy, one thread)
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import torch

from bench import shapes
from sglang_disagg_ext.backends.common import digest_kernels
from sglang_disagg_ext.backends.common.digest_kernels import rows_digest, rows_digests
from sglang_disagg_ext.core import digest as dg


def _clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    if torch.get_num_threads() > 1:  # torch's worker threads are not this thread's CPU time
        return time.perf_counter()
    return time.thread_time()


def measure(tokens: int, samples: int, device: torch.device, seed: int = 0, profile: bool = False,
            max_run: int = 0):
    pages = shapes.pages_for_tokens(tokens, shapes.PAGE_SIZE)
    item = shapes.PAGE_SIZE * shapes.KV_HEADS * shapes.KV_HEAD_DIM * shapes.DTYPE_BYTES
    pool_pages = 2 * pages + 1
    gen = torch.Generator().manual_seed(seed)
    buffers = [torch.randint(0, 256, (pool_pages, item), dtype=torch.uint8, generator=gen).to(device)
               for _ in range(2 * shapes.KV_LAYERS)]
    if max_run:  # decode's view of a busy pool: runs of 1..max_run pages, in ascending order
        src = torch.tensor(sorted(shapes.fragmented_pages(pages, pool_pages, seed, max_run)), dtype=torch.int64).to(device)
    else:
        src = torch.randperm(pool_pages, generator=gen)[:pages].to(device)
    dst_pages = [int(p) for p in torch.randperm(pool_pages, generator=gen)[:pages]]
    out = torch.empty((pages, item), dtype=torch.uint8, device=device)

    def digest():
        return dg.combine(rows_digests([(buf, dg.KV_COMPONENT, b, dst_pages, src) for b, buf in enumerate(buffers)]))

    def digest_torch():
        built = digest_kernels._KERNEL
        digest_kernels._KERNEL = False  # "no Triton here": the torch kernels
        try:
            return digest()
        finally:
            digest_kernels._KERNEL = built

    def digest_each():
        return dg.combine(rows_digest(buf, dg.KV_COMPONENT, b, dst_pages, index=src) for b, buf in enumerate(buffers))

    def gather():
        for buf in buffers:
            torch.index_select(buf, 0, src, out=out)

    runs = {"digest": digest, "gather": gather}
    if device.type != "cpu":
        runs["digest_each"] = digest_each
        runs["digest_torch"] = digest_torch
    assert all(fn() == digest() for fn in (digest, digest_each, digest_torch))  # same value every way
    gather()  # weights cached, allocator warm
    times = {name: [] for name in runs}
    names = list(runs)
    for i in range(samples):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotated: none always follows another
            t0 = _clock(device)
            runs[name]()
            times[name].append(_clock(device) - t0)
    nbytes = len(buffers) * pages * item
    if profile:
        _print_profile(digest, device)
    return pages, nbytes, times


def _print_profile(fn, device, calls: int = 5):
    """Where one digest's time goes: torch.profiler over ``calls`` calls (host and device)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
    print(f"profile of {calls} digest calls (torch.profiler, sorted by host time):")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=40))


def measure_slices(tokens: int, samples: int, heads: int = 2, head_bytes: int = 128):
    """Heterogeneous TP 1 -> 2 as the digest sees it: for one KV buffer, the head-0 slice of
    every token of a request's pages (``tokens`` slices of ``head_bytes``) from a prefill page of
    ``heads`` heads into a decode page of one. Thread CPU time of ``span_digests`` (all at once)
    and of one ``span_digest`` call per slice (timed over the first 1,000 and scaled)."""
    from sglang_disagg_ext.backends.common.digest_kernels import span_digest, span_digests

    page = shapes.PAGE_SIZE
    pages = shapes.pages_for_tokens(tokens, page)
    item, dst_item = page * heads * head_bytes, page * head_bytes
    gen = torch.Generator().manual_seed(1)
    flat = torch.randint(0, 256, (2 * pages * item,), dtype=torch.uint8, generator=gen)
    src_pages = torch.randperm(2 * pages, generator=gen)[:pages].numpy()
    dst_pages = torch.randperm(2 * pages, generator=gen)[:pages].numpy()
    slot = np.arange(page)
    src = (src_pages[:, None] * item + slot * heads * head_bytes).reshape(-1)
    dst = (dst_pages[:, None] * dst_item + slot * head_bytes).reshape(-1)
    batched = span_digests(flat, src, dst, head_bytes, dst_item, 0, 0)[0]  # weights and tables warm
    each, loop_n = [], min(1000, len(src))
    times = []
    for _ in range(samples):
        t0 = time.thread_time()
        span_digests(flat, src, dst, head_bytes, dst_item, 0, 0)
        times.append(time.thread_time() - t0)
    for _ in range(3):
        t0 = time.thread_time()
        total = 0
        for s_off, d_off in zip(src[:loop_n].tolist(), dst[:loop_n].tolist()):
            total += span_digest(flat[s_off:s_off + head_bytes], d_off, dst_item, 0, 0)[0]
        each.append((time.thread_time() - t0) * len(src) / loop_n)
    if loop_n == len(src):
        assert total & dg.MASK == batched  # same value both ways
    return len(src), len(src) * head_bytes, statistics.median(times), statistics.median(each)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--samples", type=int, default=31)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--transfer-ms", type=float, default=None,
                    help="a measured transfer time of the same request, to put the digest next to")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the bench's own process only)")
    ap.add_argument("--max-run", type=int, default=0,
                    help="source pages in ascending runs of 1..N pages (a busy pool as decode sees it); "
                         "default: random pages")
    ap.add_argument("--slices", action="store_true",
                    help="also time head slices (heterogeneous TP 1 -> 2: one slice per token) batched and one by one")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's table of the digest calls")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    pages, nbytes, times = measure(args.tokens, args.samples, device, profile=args.profile, max_run=args.max_run)
    d, g = statistics.median(times["digest"]), statistics.median(times["gather"])
    clock = "wall (synchronized)" if device.type == "cuda" else "wall" if args.threads > 1 else "thread CPU"
    print(f"digest cost, {args.tokens} tokens = {pages} pages x {2 * shapes.KV_LAYERS} KV buffers "
          f"({nbytes / 2**20:.1f} MiB), {device}, {args.samples} interleaved samples, {clock} time, "
          f"{args.threads} torch thread(s)")
    print(f"  digest (one side): median {d * 1e3:.2f} ms ({nbytes / d / 2**30:.2f} GiB/s)")
    print(f"  gather (same pages): median {g * 1e3:.2f} ms ({nbytes / g / 2**30:.2f} GiB/s)")
    print(f"  digest / gather: {d / g:.2f}")
    if "digest_each" in times:
        e = statistics.median(times["digest_each"])
        print(f"  digest_each (one copy back per buffer): median {e * 1e3:.2f} ms; digest_each / digest: {e / d:.2f}")
        t = statistics.median(times["digest_torch"])
        print(f"  digest_torch (torch kernels, no Triton): median {t * 1e3:.2f} ms; digest_torch / digest: {t / d:.2f}")
    if args.transfer_ms:
        print(f"  digest / transfer ({args.transfer_ms} ms): {d * 1e3 / args.transfer_ms:.2f} per side")
    if args.slices:
        n, nbytes, batched, each = measure_slices(args.tokens, args.samples)
        print(f"  head slices (TP 1 -> 2, one KV buffer): {n} slices, {nbytes / 2**20:.2f} MiB: span_digests "
              f"{batched * 1e3:.2f} ms, one span_digest per slice {each * 1e3:.0f} ms ({each / batched:.0f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
