"""F5 figures: offload + restore of the NSA index-key buffer vs a plain tensor copy.

A benchmark, not a test. For one retracted request it times

* **ext**: ``retract.offload_index_k`` + ``retract.restore_index_k`` (the code the
  fixed ``NSATokenToKVPool.get_cpu_copy`` / ``load_cpu_copy`` run for the index
  keys: per layer, page-indexed gather to the host in chunks, then scatter back),
* **plain**: a plain tensor copy of the same number of bytes, per layer: a
  contiguous device tensor copied to a new host tensor (``.to("cpu", copy=True)``:
  an offload has to put its copy in new host memory too) and copied back with
  ``copy_``,
* **memcpy**: the same, into a preallocated host tensor (the bandwidth bound; on CUDA a
  pinned one, as the plugin's own host copy is, so it is the device-to-host bound),
* **gather**: a plain gather and scatter of the *same pages* of the same pool, per layer,
  one memcpy per page row (CPU: NumPy fancy indexing over row-sized items, into new host
  memory and back; CUDA: ``index_select``/``index_copy_`` on 8-byte words): what the access
  pattern itself costs, so ext/gather says how much the plugin adds on top of it and
  gather/plain how much of the gap to a contiguous copy is the pattern's,

interleaved (ext, plain, memcpy, then plain, memcpy, ext, then memcpy, ext, plain, ...: the
order rotates so no variant always runs right after the same other one) and reports the medians and the
throughput ratios ext/plain and ext/memcpy from the same run. It also measures the peak extra
memory of one ext offload + restore: everything allocated beyond the host copy
it returns (CUDA: ``torch.cuda.max_memory_allocated`` on the pool's device; CPU:
the CPU allocator's events from ``torch.profiler`` with ``profile_memory``),
next to the size of one chunk, which it should stay within (plus the page index itself:
8 bytes a page for each of offload and restore).

    python -m bench.offload                  # table for a few shapes (CPU)
    python -m bench.offload --device cuda    # on a GPU machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

from sglang_disagg_ext.backends.common import retract
from sglang_disagg_ext.core.page_chunks import page_chunk_rows, page_starts, peak_chunk_bytes
from sglang_disagg_ext.selftest.scenarios.f5 import PAGE_SIZE, build_nsa_pool


def _sync(device):
    retract.synchronize_device(device)


def _request_indices(num_pages: int, request_pages: int, scattered: bool, gen: torch.Generator, device) -> torch.Tensor:
    """Token slots of one request: ``request_pages`` full pages (page 0 is SGLang's padding page)."""
    if scattered:
        pages = torch.randperm(num_pages, generator=gen)[:request_pages] + 1
    else:
        pages = torch.arange(1, request_pages + 1)
    tokens = (pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(-1)
    return tokens.to(device=device, dtype=torch.int32)  # req_to_token is int32


def _cpu_peak_extra(fn, kept_bytes_of) -> int:
    """Peak bytes the CPU allocator held during ``fn()`` beyond what ``fn`` returns and keeps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(
        ((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage),
        key=lambda x: x[0],
    )
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return max(0, peak - kept_bytes_of(result))


def _cuda_peak_extra(fn, device):
    """(requested, allocated) peak bytes beyond those held before ``fn()``. Requested is what the
    code asked the caching allocator for; allocated adds the allocator's own rounding (a request
    served from a cached block up to 1 MiB larger counts that whole block)."""
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_stats(device)
    fn()
    _sync(device)
    after = torch.cuda.memory_stats(device)
    requested = after["requested_bytes.all.peak"] - before["requested_bytes.all.current"]
    allocated = after["allocated_bytes.all.peak"] - before["allocated_bytes.all.current"]
    return requested, allocated


def measure_offload(
    layer_num: int = 8,
    num_pages: int = 512,
    request_pages: int = 256,
    chunk_tokens: Optional[int] = None,
    repeats: int = 21,
    device: str = "cpu",
    scattered: bool = True,
    seed: int = 0,
) -> Dict:
    """Offload + restore figures for one request's index-key pages (see module doc)."""
    pool = build_nsa_pool(layer_num=layer_num, num_pages=num_pages, device=device, chunk_tokens=chunk_tokens,
                          kv_lora_rank=64, qk_rope_head_dim=64)
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.index_k_with_scale_buffer:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    indices = _request_indices(num_pages, request_pages, scattered, gen, device)
    row_bytes = pool.index_k_with_scale_buffer[0][0].nbytes
    total_bytes = layer_num * request_pages * row_bytes
    chunk_rows = page_chunk_rows(pool.cpu_offloading_chunk_size, pool.page_size)

    # The plain copies: the same bytes, contiguous, per layer.
    src = [torch.randint(0, 256, (request_pages, row_bytes), generator=gen, dtype=torch.uint8).to(device)
           for _ in range(layer_num)]
    # memcpy gets a source of its own: with a shared one, plain's source would be warmed by memcpy too,
    # while ext's (the pool) is touched by ext alone.
    memcpy_src = [s.clone() for s in src]
    pinned = torch.device(device).type == "cuda"
    host = [torch.empty(request_pages, row_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(layer_num)]

    def ext_round_trip():
        copy = retract.offload_index_k(pool, indices)
        _sync(device)
        retract.restore_index_k(pool, copy, indices)
        _sync(device)
        return copy

    def plain_round_trip():
        copies = [s.to("cpu", copy=True) for s in src]
        _sync(device)
        for s, h in zip(src, copies):
            s.copy_(h)
        _sync(device)

    layers = list(pool.index_k_with_scale_buffer)
    page_index = torch.as_tensor(page_starts(indices, pool.page_size)).to(device=device, dtype=torch.int64)

    if torch.device(device).type == "cpu":
        # One memcpy per page row: NumPy fancy indexing over opaque row-sized items.
        row_views = [retract._numpy_rows(layer) for layer in layers]
        page_np = page_index.numpy()

        def gather_round_trip():
            copies = [rows[page_np] for rows in row_views]
            for rows, h in zip(row_views, copies):
                rows[page_np] = h
    else:
        wide = [layer.view(torch.int64) for layer in layers]

        def gather_round_trip():
            copies = [w.index_select(0, page_index).to("cpu") for w in wide]
            _sync(device)
            for w, h in zip(wide, copies):
                w.index_copy_(0, page_index, h.to(w.device))
            _sync(device)

    def memcpy_round_trip():
        for s, h in zip(memcpy_src, host):
            h.copy_(s)
        _sync(device)
        for s, h in zip(memcpy_src, host):
            s.copy_(h)
        _sync(device)

    # Correctness of what is being timed: the round trip gives back the same bytes.
    before = [buf.clone() for buf in pool.index_k_with_scale_buffer]
    copy = ext_round_trip()
    assert all(torch.equal(a, b) for a, b in zip(before, pool.index_k_with_scale_buffer))
    assert sum(t.nbytes for layer in copy for t in layer) == total_bytes
    del before, copy

    timings: Dict[str, List[float]] = {"ext": [], "plain": [], "memcpy": [], "gather": []}
    runs = {"ext": ext_round_trip, "plain": plain_round_trip, "memcpy": memcpy_round_trip,
            "gather": gather_round_trip}
    for fn in runs.values():  # warm-up
        fn()
    names = list(runs)
    for rep in range(repeats):
        # Rotate which variant goes first: each one then follows each other equally often, so none
        # always runs on memory (host pages, cache lines) that the one before it just freed or warmed.
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            runs[name]()
            timings[name].append(time.perf_counter() - t0)
    ext_med, plain_med, memcpy_med, gather_med = (
        statistics.median(timings[k]) for k in ("ext", "plain", "memcpy", "gather"))

    if torch.device(device).type == "cuda":
        peak_extra, peak_allocated = _cuda_peak_extra(ext_round_trip, device)
        peak_method = ("torch.cuda.memory_stats requested_bytes peak (device; allocated_bytes, with the caching "
                       "allocator's rounding, in peak_extra_allocated_bytes)")
    else:
        peak_allocated = None
        peak_extra = _cpu_peak_extra(ext_round_trip, lambda c: sum(t.nbytes for layer in c for t in layer))
        peak_method = "torch.profiler CPU allocator events, minus the returned host copy"
    one_chunk = peak_chunk_bytes(request_pages, chunk_rows, row_bytes)
    # Besides the chunk, offload and restore each hold the request's page index on the pool's
    # device (int64, 8 bytes a page: on an H100, 1.5-24 KiB for 128-2048 pages, 12 bytes a page).
    index_bytes = 2 * 8 * request_pages

    return {
        "device": str(device),
        "layers": layer_num,
        "request_pages": request_pages,
        "scattered": scattered,
        "chunk_tokens": pool.cpu_offloading_chunk_size,
        "chunk_pages": chunk_rows,
        "bytes": total_bytes,
        "repeats": repeats,
        "ext_s": ext_med,
        "plain_s": plain_med,
        "ext_GBps": 2 * total_bytes / ext_med / 1e9,  # offload + restore move the bytes twice
        "plain_GBps": 2 * total_bytes / plain_med / 1e9,
        "memcpy_s": memcpy_med,
        "memcpy_GBps": 2 * total_bytes / memcpy_med / 1e9,
        "ratio": plain_med / ext_med,  # ext throughput / plain-copy throughput
        "ratio_memcpy": memcpy_med / ext_med,  # ext throughput / preallocated memcpy throughput
        "gather_s": gather_med,
        "gather_GBps": 2 * total_bytes / gather_med / 1e9,
        "ratio_gather": gather_med / ext_med,  # ext throughput / torch's gather+scatter of the same pages
        "gather_over_plain": plain_med / gather_med,  # the access pattern alone vs a contiguous copy
        "peak_extra_bytes": peak_extra,
        "peak_extra_allocated_bytes": peak_allocated,
        "one_chunk_bytes": one_chunk,
        "index_bytes": index_bytes,
        "within_one_chunk": peak_extra <= one_chunk + index_bytes,
        "peak_method": peak_method,
        "torch_threads": torch.get_num_threads(),
    }


DEFAULT_CASES = [
    dict(request_pages=128, chunk_tokens=None, scattered=True),  # 8k-token request, one default chunk
    dict(request_pages=256, chunk_tokens=None, scattered=True),  # 16k tokens, two chunks
    dict(request_pages=256, chunk_tokens=2048, scattered=True),  # 32-page chunks
    dict(request_pages=256, chunk_tokens=None, scattered=False),  # contiguous pages
]


# A long request (128k tokens: 2048 pages, 16 chunks of the default size), for a GPU, where the
# default cases' 8-16 MiB are over in well under a millisecond and launch costs dominate.
LARGE_CASES = [
    dict(request_pages=2048, num_pages=4096, chunk_tokens=None, scattered=True),
    dict(request_pages=2048, num_pages=4096, chunk_tokens=None, scattered=False),
]


def format_table(rows: List[Dict]) -> str:
    head = ("pages", "scattered", "chunk", "MiB", "ext ms", "plain ms", "memcpy ms", "ext GB/s", "plain GB/s",
            "ratio ext/plain", "ratio ext/memcpy", "gather ms", "ratio ext/gather", "ratio gather/plain",
            "peak extra KiB", "1 chunk KiB", "within")
    lines = [" | ".join(head)]
    for r in rows:
        lines.append(" | ".join(str(x) for x in (
            r["request_pages"], "y" if r["scattered"] else "n", f'{r["chunk_tokens"]}t/{r["chunk_pages"]}p',
            f'{r["bytes"] / 2**20:.1f}', f'{r["ext_s"] * 1e3:.2f}', f'{r["plain_s"] * 1e3:.2f}',
            f'{r["memcpy_s"] * 1e3:.2f}', f'{r["ext_GBps"]:.2f}', f'{r["plain_GBps"]:.2f}', f'{r["ratio"]:.2f}',
            f'{r["ratio_memcpy"]:.2f}', f'{r["gather_s"] * 1e3:.2f}', f'{r["ratio_gather"]:.2f}',
            f'{r["gather_over_plain"]:.2f}',
            f'{r["peak_extra_bytes"] / 1024:.1f}', f'{r["one_chunk_bytes"] / 1024:.0f}',
            "yes" if r["within_one_chunk"] else "NO",
        )))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a small shared box, more threads mostly add hand-off "
                         "cost; 0 keeps torch's default)")
    ap.add_argument("--large", action="store_true", help="add two 128k-token cases (about 135 MiB each; for a GPU)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure_offload(layer_num=args.layers, repeats=args.repeats, device=args.device, **case)
            for case in DEFAULT_CASES + (LARGE_CASES if args.large else [])]
    import sglang_disagg_ext.releases as rel

    print(f"F5 index-key offload+restore vs plain copy; SGLang {rel.installed_sglang_version()}, "
          f"torch {torch.__version__}, {args.layers} layers, median of {args.repeats} interleaved repeats, "
          f"{rows[0]['torch_threads']} torch threads, device {args.device}")
    print(format_table(rows))
    print(f"peak extra memory: {rows[0]['peak_method']}")
    if rows[0]["peak_extra_allocated_bytes"] is not None:
        print("peak extra allocated KiB: " + ", ".join(f'{r["peak_extra_allocated_bytes"] / 1024:.1f}' for r in rows))
    return 0 if all(r["within_one_chunk"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
