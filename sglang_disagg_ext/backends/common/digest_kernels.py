"""Digest kernels: ``core.digest``'s definition computed over pool rows on the rows' own device.

Used by the verified-transfer paths (``verify``: prefill's source blocks at their
destination placement, decode's landed pages) and by F5's retract check (``retract``). No
SGLang import. ``rows_digests`` is the entry for whole items (numpy on CPU; on a device one
fused Triton kernel per call, or torch kernels where Triton is missing); ``span_digest`` for
byte ranges that are not whole items (head slices).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from sglang_disagg_ext.core import digest as dg

# # Whole items go through the 64-bit word path (``core.digest``: one uint64 word
# per 8 bytes, product and sum mod 2**64). On CPU that is one numpy ``einsum``
# over the bytes viewed as uint64: a single read pass, no widened copy, no
# temporary (one thread, as the gathers: NumPy's ``take``) (measured with
# ``python -m bench.digest``: torch's ``x * w`` then ``sum`` allocates a
# product as large as the rows, and ``sum(dtype=int64)`` over int32 casts the
# whole input first). On a device: :func:`rows_digests`.

_WEIGHTS: Dict[Tuple[str, int, bool], object] = {}
_WEIGHTS_LOCK = threading.Lock()


def _weights(device: torch.device, n: int, by_word: bool):
    """Cached weights: ``base(0 .. n-1)`` per 64-bit word (``by_word``; numpy uint64 on
    CPU, torch int64 elsewhere) or per byte of an ``n``-byte item (torch int64)."""
    if by_word and device.type == "cpu":
        return _cpu_weights(n)
    key = (str(device), n, by_word)
    w = _WEIGHTS.get(key)
    if w is None:
        vec = dg.base_vector(n) if by_word else dg.byte_weight_vector(n)
        w = torch.from_numpy(vec.view(np.int64)).to(device)
        with _WEIGHTS_LOCK:
            _WEIGHTS[key] = w
    return w


def _page_factors(device, component, buffer, pages) -> torch.Tensor:
    return torch.from_numpy(dg.page_factors(component, buffer, pages).view(np.int64)).to(device)


_SLOTS = np.empty(0, dtype=np.uint64)
_SLOTS_CAP = 1 << 20  # pages: 8 MiB at most, one table for every buffer of the process


def _slot_factors(pages) -> np.ndarray:
    """``core.digest.slot_factor`` of ``pages`` (uint64), looked up in a table grown on
    demand (computing them per call was a sixth of the digest's time at 8K tokens)."""
    global _SLOTS
    pages = np.asarray(pages, dtype=np.int64).reshape(-1)
    if pages.size == 0:
        return np.empty(0, dtype=np.uint64)
    lo, hi = int(pages.min()), int(pages.max())
    table = _SLOTS
    if lo < 0 or hi >= table.size:
        if lo < 0 or hi >= _SLOTS_CAP:
            return dg.slot_factors(pages)  # directly; raises DigestError for a page out of range
        with _WEIGHTS_LOCK:
            if hi >= _SLOTS.size:
                _SLOTS = dg.slot_factors(np.arange(min(_SLOTS_CAP, max(4096, 1 << hi.bit_length()))))
            table = _SLOTS
    return table[pages]


_RUN_MIN_BYTES = 64 << 10  # average contiguous run at which rows are digested in place, not gathered
_SMALL_GATHER = 64 << 10  # rows of at most this many bytes in all (aux rows, a state slot): one copy, no run analysis
_GATHER_CHUNK = 1 << 20  # bytes gathered per step on CPU (1 MiB: 1.07 ms vs 1.21 ms at 512 KiB, 1.63 ms at 128 KiB for 8 x 1 MiB fragmented KV; larger gains nothing)
_SCRATCH = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's reusable CPU gather buffer, at least ``nbytes`` (a fresh ~1 MiB
    tensor per call costs page faults when the allocator returns it to the OS)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _SCRATCH.buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf


class _RowPlan:
    """A row index as the CPU kernel uses it: int64 row numbers, their bounds and (on demand)
    where their contiguous runs break. Built once per index object of a :func:`rows_digests`
    call and shared by every pool it indexes (a request's layers all take the same rows)."""

    __slots__ = ("idx", "lo", "hi", "_breaks")

    def __init__(self, idx: np.ndarray):
        self.idx = idx
        self.lo, self.hi = (int(idx.min()), int(idx.max())) if idx.size else (0, -1)
        self._breaks = None

    def breaks(self) -> np.ndarray:
        if self._breaks is None:
            self._breaks = np.flatnonzero(np.diff(self.idx) != 1) + 1
        return self._breaks


def _host_index(index) -> np.ndarray:
    """``index`` (any int sequence, array or CPU tensor) as a flat int64 array, no copy where it is one."""
    if isinstance(index, torch.Tensor):
        index = index.numpy()
    return np.asarray(index, dtype=np.int64).reshape(-1)


def _cpu_item_sums(pool: np.ndarray, plan: Optional[_RowPlan]) -> np.ndarray:
    """``v(item)`` of every item (uint64): ``pool`` (uint8, ``(rows, item_len)``) contiguous,
    a multiple of 8 bytes wide; with ``plan``, of rows ``plan.idx`` of ``pool``
    (:class:`IndexError` for a row outside it: NumPy's indexing would wrap a negative one)."""
    n_rows, item_len = pool.shape
    w = _cpu_weights(item_len // dg.WORD_BYTES)
    if plan is None:
        return np.einsum("ij,j->i", pool.view(np.uint64), w)  # one pass, wraps mod 2**64
    if plan.lo < 0 or plan.hi >= n_rows:
        bad = plan.lo if plan.lo < 0 else plan.hi
        raise IndexError(f"row {bad} outside {n_rows} rows")
    idx = plan.idx
    n = idx.size
    if n * item_len <= _SMALL_GATHER:
        # A few rows (a request's aux row per metadata buffer, one state slot): NumPy's indexed
        # copy and one einsum. The run analysis below costs more than copying them (10 aux rows:
        # 171 us -> 67 us CPU for the whole call on this project's machine).
        return np.einsum("ij,j->i", pool[idx].view(np.uint64), w)
    breaks = plan.breaks()
    if (len(breaks) + 1) * _RUN_MIN_BYTES <= n * item_len:
        # Long contiguous runs (a fresh pool's usual layout; a busy one's runs of about
        # eight 8 KiB pages): each in place, no gather. Shorter runs are gathered: one
        # einsum call per run costs more than the copy (python -m bench.digest --max-run 2, 8).
        words = pool.view(np.uint64)
        out = np.empty(n, dtype=np.uint64)
        for lo, hi in zip(np.concatenate(([0], breaks)).tolist(), np.concatenate((breaks, [n])).tolist()):
            start = int(idx[lo])
            np.einsum("ij,j->i", words[start:start + hi - lo], w, out=out[lo:hi])
        return out
    # The gather is NumPy's ``take`` (one memcpy per row, on this thread), not
    # ``torch.index_select``: that one runs on torch's intra-op pool, and with the
    # transfer engine and the other side busy on the same cores its hand-offs cost
    # far more than the copy (1 MiB of 8 KiB rows on this 2-vCPU machine, under
    # load: 6.9 ms with torch's 2 threads, 0.03 ms with 1, 0.07 ms with ``take``).
    step = max(1, _GATHER_CHUNK // item_len)
    scratch = _scratch(min(n, step) * item_len).numpy()
    out = np.empty(n, dtype=np.uint64)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        part = scratch[: (hi - lo) * item_len].reshape(hi - lo, item_len)
        np.take(pool, idx[lo:hi], axis=0, out=part, mode="clip")  # bounds checked above
        np.einsum("ij,j->i", part.view(np.uint64), w, out=out[lo:hi])
    return out


_CPU_WEIGHTS: Dict[int, np.ndarray] = {}


def _cpu_weights(n_words: int) -> np.ndarray:
    """``base(0 .. n_words-1)`` (numpy uint64), cached: the CPU's word weights, which
    :func:`_weights` hands out too (keyed by width alone: the CPU path asks once per buffer
    per call, and a device key costs a ``str(device)`` each time)."""
    w = _CPU_WEIGHTS.get(n_words)
    if w is None:
        w = dg.base_vector(n_words)
        with _WEIGHTS_LOCK:
            _CPU_WEIGHTS[n_words] = w
    return w


@functools.lru_cache(maxsize=1 << 16)
def _buffer_factor(component: int, buffer: int) -> int:
    """``core.digest.buffer_factor``, cached (a splitmix in Python per buffer per call)."""
    return dg.buffer_factor(component, buffer)


def _cpu_ready(rows, index) -> bool:
    """Whether ``rows`` (and ``index``) go to the CPU kernel as they are: host rows, contiguous,
    a multiple of 8 bytes wide (tensors also 8-byte aligned), and a host index (or none)."""
    if isinstance(rows, np.ndarray):  # NumPy reads unaligned words too (slower): no address check
        ok = rows.ndim == 2 and rows.flags.c_contiguous
    else:
        ok = rows.device.type == "cpu" and rows.dim() == 2 and rows.is_contiguous() \
            and rows.data_ptr() % dg.WORD_BYTES == 0
    return (ok and rows.shape[1] % dg.WORD_BYTES == 0
            and not (isinstance(index, torch.Tensor) and index.device.type != "cpu"))


def rows_digest(rows: torch.Tensor, component: int, buffer: int, dst_pages, index=None) -> int:
    """Digest of whole items placed at destination pages ``dst_pages`` of (component, buffer).

    ``rows`` is uint8 of shape ``(n, item_len)`` (a tensor, or a NumPy array of host
    rows): the items themselves, or, with
    ``index`` (row numbers, any int sequence or tensor), a pool whose rows
    ``index`` are the items (``dst_pages[i]`` is where row ``index[i]`` lands;
    gathered here in bounded steps on CPU)."""
    return rows_digests([(rows, component, buffer, dst_pages, index)])[0]


def rows_digests(requests) -> List[int]:
    """:func:`rows_digest` of each ``(rows, component, buffer, dst_pages, index)``.

    On a device every request costs three kernels (gather, weigh, sum per item) and the
    call a handful more: the per-item sums of all requests are weighed by their slot
    factors and summed per request together, with the slot factors, request numbers and
    buffer factors going over in one host-to-device copy and the totals coming back in
    one copy. On an H100 the digest was bound by kernel launches and copies, not bytes
    (bench/gpu_checks.sh: 8 buffers of 1 MiB took 1.37 ms with about ten kernels and a
    copy back per buffer, 106 us of it on the GPU; a gather of the same pages 0.13 ms)."""
    out: List[int] = [0] * len(requests)
    on_device: Dict[torch.device, list] = {}
    slots_of: Dict[int, Tuple[object, np.ndarray]] = {}  # id(dst_pages) -> (dst_pages, slot factors)
    # Callers pass one row index and one page list for every buffer of a component (its
    # layers take the same rows to the same pages): each is analysed once per call, keyed by
    # the object (kept with it, so its id is not reused meanwhile).
    plans: Dict[int, Tuple[object, Optional[_RowPlan]]] = {}
    singles: List[tuple] = []  # (i, item words, page, component, buffer): one small item each
    for i, (rows, component, buffer, dst_pages, index) in enumerate(requests):
        if _cpu_ready(rows, index):
            # The CPU path, lean: per buffer a dictionary lookup or two and the kernel's calls.
            plan = None
            if index is not None:
                hit = plans.get(id(index))
                if hit is None or hit[0] is not index:
                    hit = plans[id(index)] = (index, _RowPlan(_host_index(index)))
                plan = hit[1]
                if plan.idx.size == 0:
                    continue  # nothing placed: 0
            elif rows.shape[0] == 0:
                continue
            pool = rows if isinstance(rows, np.ndarray) else rows.numpy()
            n_items = pool.shape[0] if plan is None else plan.idx.size
            if n_items == 1 and pool.shape[1] <= _SMALL_GATHER and len(dst_pages) == 1:
                # One small item (a metadata row, a state slot): digested with the call's other
                # such items in one vectorised pass (:func:`_single_item_digests`).
                row = 0 if plan is None else plan.lo
                if not 0 <= row < pool.shape[0]:
                    raise IndexError(f"row {row} outside {pool.shape[0]} rows")
                singles.append((i, pool[row].view(np.uint64), dst_pages[0], component, buffer))
                continue
            slots = _slots_of(slots_of, dst_pages)
            per_item = _cpu_item_sums(pool, plan)
            # page_factor = buffer_factor * slot_factor: slots per item, the buffer's factor once.
            out[i] = (int(np.dot(per_item, slots)) * _buffer_factor(component, buffer)) & dg.MASK  # dot wraps
            continue
        if isinstance(rows, np.ndarray):  # host rows the CPU kernel cannot take as they are
            rows = torch.from_numpy(rows)
        prepared = _prepared_rows(rows, index)
        if prepared is None:
            continue  # nothing placed: 0
        rows, index = prepared
        bf = _buffer_factor(component, buffer)
        slots = _slots_of(slots_of, dst_pages)
        if rows.device.type == "cpu":  # padded or realigned by _prepared_rows
            plan = None if index is None else _RowPlan(_host_index(index))
            out[i] = (int(np.dot(_cpu_item_sums(rows.numpy(), plan), slots)) * bf) & dg.MASK
        else:
            on_device.setdefault(rows.device, []).append((i, rows, index, slots, bf))
    if singles:
        for (i, _, _, _, _), value in zip(singles, _single_item_digests(singles)):
            out[i] = value
    for device, items in on_device.items():
        # On the rows' device, whatever this thread's current device is: SGLang's transfer
        # threads and the verify digest threads start on device 0, a rank's pool may not.
        with torch.cuda.device(device) if device.type == "cuda" else _NO_DEVICE_SCOPE:
            totals = _device_totals(device, items)
        for (i, _, _, _, _), value in zip(items, totals):
            out[i] = value
    return out


_CONCAT_WEIGHTS: Dict[Tuple[int, ...], Tuple[np.ndarray, np.ndarray]] = {}


def _single_item_digests(singles) -> List[int]:
    """Digests of ``(i, words, page, component, buffer)`` items, one item each (uint64 words, any
    widths), in one pass: every item's words weighed by ``base(k)`` and summed per item
    (``np.add.reduceat``), times its slot and buffer factors, all mod 2**64. A request's ten
    metadata rows, one per buffer, cost a call each through the general path."""
    widths = tuple(len(s[1]) for s in singles)
    hit = _CONCAT_WEIGHTS.get(widths)
    if hit is None:
        if len(_CONCAT_WEIGHTS) > 256:  # one per metadata layout in practice: bounded anyway
            _CONCAT_WEIGHTS.clear()
        hit = _CONCAT_WEIGHTS[widths] = (np.concatenate([_cpu_weights(n) for n in widths]),
                                         np.cumsum((0,) + widths[:-1]))
    weights, starts = hit
    sums = np.add.reduceat(np.concatenate([s[1] for s in singles]) * weights, starts)  # uint64: wraps
    sums *= _slot_factors([s[2] for s in singles])
    sums *= np.array([_buffer_factor(s[3], s[4]) for s in singles], dtype=np.uint64)
    return sums.tolist()


def _slots_of(cache: Dict[int, Tuple[object, np.ndarray]], dst_pages) -> np.ndarray:
    """Slot factors of ``dst_pages``, looked up once per page list object per call (``cache``
    keeps the object, so its id is not reused meanwhile)."""
    hit = cache.get(id(dst_pages))
    if hit is None or hit[0] is not dst_pages:
        hit = cache[id(dst_pages)] = (dst_pages, _slot_factors(dst_pages))
    return hit[1]


def _prepared_rows(rows: torch.Tensor, index):
    """``(rows, index)`` ready for the digest kernels (int64 index, on the host unless it came as
    a device tensor; rows contiguous, 8-byte aligned and a multiple of 8 bytes wide), or None if
    no item is placed."""
    if index is not None:
        if not isinstance(index, torch.Tensor):
            index = torch.from_numpy(np.asarray(index, dtype=np.int64).reshape(-1))
        index = index.to(dtype=torch.int64)  # where it is: a host index goes over with the rest
        if index.numel() == 0:
            return None
    elif rows.shape[0] == 0:
        return None
    item_len = rows.shape[1]
    pad = -item_len % dg.WORD_BYTES
    if pad or not rows.is_contiguous() or rows.data_ptr() % dg.WORD_BYTES or rows.storage_offset() % dg.WORD_BYTES:
        # Zero-padded tail (the definition's) and an aligned, contiguous copy: rare
        # (KV, state and aux items are multiples of 8 bytes, pools are aligned).
        if index is not None:
            rows, index = rows.index_select(0, index.to(rows.device)), None
        padded = torch.zeros((rows.shape[0], item_len + pad), dtype=torch.uint8, device=rows.device)
        padded[:, :item_len] = rows
        rows = padded
    return rows, index


_NO_DEVICE_SCOPE = contextlib.nullcontext()
_STAGING = threading.local()


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (int64) on ``device`` in one asynchronous copy, through this thread's pinned
    staging buffer (``Tensor.pin_memory()`` asks the driver whether the memory is pinned first:
    0.7 ms a call on the lent H100's VM, most of the digest's host time). Reusing the buffer is
    safe: every call that copies from it ends by copying its totals back, which waits for the
    copy in."""
    if device.type != "cuda":
        return torch.from_numpy(host).to(device)
    staging = getattr(_STAGING, "buf", None)
    if staging is None or staging.numel() < host.size:
        staging = _STAGING.buf = torch.empty(max(host.size, 1 << 12), dtype=torch.int64, pin_memory=True)
    part = staging[: host.size]
    part.numpy()[:] = host
    return part.to(device, non_blocking=True)


def _device_totals(device: torch.device, items) -> List[int]:
    """Digests of ``items`` (``(i, rows, index, slot factors, buffer factor)``, rows on
    ``device``) with torch int64 arithmetic, whose products and sums wrap mod 2**64 like the
    uint64 definition (two's complement). Runs on any device (the unit tests use CPU)."""
    if device.type == "cuda" and _digest_kernel() is not None:
        return _kernel_totals(device, items)
    sums = []
    for _, rows, index, _, _ in items:
        if index is not None:
            rows = rows.index_select(0, index.to(device))
        w = _weights(device, rows.shape[1] // dg.WORD_BYTES, True)
        if isinstance(w, np.ndarray):  # CPU's cached weights are numpy uint64: the same bits as int64
            w = torch.from_numpy(w.view(np.int64))
        sums.append((rows.view(torch.int64) * w).sum(dim=1))
    n, k = sum(len(x) for x in sums), len(items)
    host = np.concatenate([
        np.concatenate([it[3] for it in items]).view(np.int64),  # slot factor of every item
        np.repeat(np.arange(k, dtype=np.int64), [len(x) for x in sums]),  # its request
        np.array([it[4] for it in items], dtype=np.uint64).view(np.int64),  # buffer factor per request
    ])
    factors = _to_device(host, device)
    weighed = torch.cat(sums) * factors[:n]
    totals = torch.zeros(k, dtype=torch.int64, device=device).index_add_(0, factors[n:2 * n], weighed)
    totals *= factors[2 * n:]
    return totals.cpu().numpy().view(np.uint64).tolist()


_KERNEL = None
_KERNEL_LOCK = threading.Lock()
_KERNEL_MAX_BLOCK = 1024  # words per step of one item (8 KiB)


def _digest_kernel():
    """The fused digest kernel (Triton), built on first use; None where Triton cannot be imported
    (then the torch kernels above serve). One program per item: it reads the item's words from
    its pool row (pool address, words per row and row number from tables), weighs and sums them
    in wrapping int64, and stores that sum times the item's page factor (slot x buffer): gather,
    weigh and sum of every buffer of a call in one launch."""
    global _KERNEL
    with _KERNEL_LOCK:
        if _KERNEL is None:
            try:
                import triton
                import triton.language as tl
            except ImportError:
                _KERNEL = False
                return None

            @triton.jit
            def item_digests(bases, words, index, request, weights, factors, out, BLOCK: tl.constexpr,
                             STEPS: tl.constexpr):
                i = tl.program_id(0)
                r = tl.load(request + i)
                base = tl.load(bases + r).to(tl.pointer_type(tl.int64))
                n_words = tl.load(words + r)
                row = tl.load(index + i)
                acc = tl.zeros((BLOCK,), dtype=tl.int64)
                for step in range(STEPS):  # enough steps for the widest item; masked beyond each's width
                    j = step * BLOCK + tl.arange(0, BLOCK)
                    inside = j < n_words
                    x = tl.load(base + row * n_words + j, mask=inside, other=0)
                    acc += x * tl.load(weights + j, mask=inside, other=0)
                tl.store(out + i, tl.sum(acc, axis=0) * tl.load(factors + i))

            _KERNEL = (item_digests, triton.next_power_of_2)
        return _KERNEL or None


def _kernel_totals(device: torch.device, items) -> List[int]:
    """:func:`_device_totals` through :func:`_digest_kernel`: the row numbers, requests, page
    factors, pool addresses and row widths of every item go over in one host-to-device copy, one
    launch digests every item, one ``index_add_`` sums them per request, one copy brings the
    totals back. ``rows`` stay referenced by ``items`` until then."""
    kernel, next_power_of_2 = _digest_kernel()
    counts = [index.numel() if index is not None else rows.shape[0] for _, rows, index, _, _ in items]
    n, k = sum(counts), len(items)
    host_index = np.empty(n, dtype=np.int64)
    on_device = []  # (offset, count, index) of row numbers already on the device
    factors = []
    offset = 0
    for (_, rows, index, slots, bf), count in zip(items, counts):
        if index is None:
            host_index[offset:offset + count] = np.arange(count)
        elif index.device.type == "cpu":
            host_index[offset:offset + count] = index.numpy()
        else:
            on_device.append((offset, count, index))
        with np.errstate(over="ignore"):  # page factor = slot factor x buffer factor, mod 2**64
            factors.append(slots * np.uint64(bf))
        offset += count
    widths = [rows.shape[1] // dg.WORD_BYTES for _, rows, _, _, _ in items]
    host = np.concatenate([
        host_index,
        np.repeat(np.arange(k, dtype=np.int64), counts),
        np.concatenate(factors).view(np.int64),
        np.array([rows.data_ptr() for _, rows, _, _, _ in items], dtype=np.int64),
        np.array(widths, dtype=np.int64),
    ])
    table = _to_device(host, device)
    index_d, request_d, factors_d = table[:n], table[n:2 * n], table[2 * n:3 * n]
    bases_d, words_d = table[3 * n:3 * n + k], table[3 * n + k:]
    for offset, count, index in on_device:
        index_d[offset:offset + count].copy_(index)
    longest = max(widths)
    weights = _weights(device, longest, True)
    if isinstance(weights, np.ndarray):  # CPU (the interpreter in the unit tests)
        weights = torch.from_numpy(weights.view(np.int64))
    per_item = torch.empty(n, dtype=torch.int64, device=device)
    block = min(_KERNEL_MAX_BLOCK, next_power_of_2(longest))
    kernel[(n,)](bases_d, words_d, index_d, request_d, weights, factors_d, per_item,
                 BLOCK=block, STEPS=-(-longest // block))
    totals = torch.zeros(k, dtype=torch.int64, device=device).index_add_(0, request_d, per_item)
    return totals.cpu().numpy().view(np.uint64).tolist()


def span_digest(data: torch.Tensor, dst_offset: int, item_len: int, component: int, buffer: int):
    """Digest of ``data`` (flat uint8) written at byte ``dst_offset`` of destination buffer
    (component, buffer) of items ``item_len`` long: any alignment (head slices, partial
    items), byte by byte with ``core.digest``'s per-byte weights (slower than
    :func:`rows_digest`; only slices take it). Returns (digest, destination pages touched)."""
    pos = torch.arange(dst_offset, dst_offset + data.numel(), dtype=torch.int64, device=data.device)
    pages = pos // item_len
    first, last = dst_offset // item_len, (dst_offset + data.numel() - 1) // item_len
    page_list = list(range(first, last + 1))
    m = _page_factors(data.device, component, buffer, page_list)
    w = _weights(data.device, item_len, False)[pos % item_len] * m[pages - first]
    return int((data.to(torch.int64) * w).sum().item()) & dg.MASK, page_list


def _numpy_path(device: torch.device) -> bool:
    """Whether span digests on ``device`` run in numpy (CPU) rather than torch (a unit test
    runs the torch path on CPU by answering False)."""
    return device.type == "cpu"


_SPAN_CHUNK_UNITS = 1 << 17  # words (or bytes) gathered per step: 1 MiB of words, bounded temporaries


def span_digests(flat: torch.Tensor, src_offsets, dst_offsets, length: int, item_len: int, component: int,
                 buffer: int) -> Tuple[int, np.ndarray]:
    """:func:`span_digest` of many spans at once: span ``k`` is ``length`` bytes of ``flat`` (a
    flat uint8 buffer) from ``src_offsets[k]``, written at byte ``dst_offsets[k]`` of destination
    buffer (component, buffer) whose items are ``item_len`` long. Every span lies inside one
    destination item (:class:`ValueError` otherwise): a head slice of one token, the shape a
    heterogeneous-TP transfer has by the hundred thousand per request, where one call per span
    cost a Python round per slice. Returns (digest, destination pages touched, ascending).

    Spans are grouped by their offset inside the item (a handful of distinct values: the token
    slots of a page), each group gathered in bounded steps and weighed with the item's weights
    from that offset on: 64-bit words where length, offsets and buffer are 8-byte aligned (head
    slices are), single bytes with their byte weights otherwise. Runs on ``flat``'s device."""
    src = np.asarray(src_offsets, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_offsets, dtype=np.int64).reshape(-1)
    if src.size == 0:
        return 0, np.empty(0, dtype=np.int64)
    pages = dst // item_len
    within = dst - pages * item_len
    if ((within + length) > item_len).any() or length <= 0:
        raise ValueError(f"spans of {length} bytes must each lie inside one {item_len}-byte item")
    if (src < 0).any() or int(src.max()) + length > flat.numel():
        raise IndexError(f"span outside the {flat.numel()}-byte source buffer")
    word = (length % dg.WORD_BYTES == 0 and not (src % dg.WORD_BYTES).any()
            and not (within % dg.WORD_BYTES).any() and flat.data_ptr() % dg.WORD_BYTES == 0)
    unit = dg.WORD_BYTES if word else 1
    n_units = length // unit
    usable = flat.numel() // unit * unit
    cpu = _numpy_path(flat.device)
    # The item's weights from the cache: per word (numpy uint64 on CPU, else int64) or per byte (int64).
    weights = _weights(flat.device, -(-item_len // dg.WORD_BYTES) if word else item_len, word)
    if cpu:
        data = flat[:usable].numpy().view(np.uint64 if word else np.uint8)
        if isinstance(weights, torch.Tensor):
            weights = weights.cpu().numpy().view(np.uint64)
    else:
        data = flat[:usable].view(torch.int64) if word else flat[:usable]
        if isinstance(weights, np.ndarray):
            weights = torch.from_numpy(weights.view(np.int64))
    per = np.empty(src.size, dtype=np.uint64)
    order = np.argsort(within, kind="stable")
    step = max(1, _SPAN_CHUNK_UNITS // n_units)
    cols = np.arange(n_units, dtype=np.int64)
    bounds = np.flatnonzero(np.diff(within[order])) + 1
    for group in np.split(order, bounds):
        o = int(within[group[0]]) // unit
        for lo in range(0, group.size, step):
            part = group[lo:lo + step]
            idx = src[part][:, None] // unit + cols
            if cpu:
                vals = data[idx]
                if not word:
                    vals = vals.astype(np.uint64)
                per[part] = np.einsum("ij,j->i", vals, weights[o:o + n_units])  # wraps mod 2**64
            else:
                vals = data[torch.from_numpy(idx).to(flat.device)].to(torch.int64)
                per[part] = (vals * weights[o:o + n_units]).sum(dim=1).cpu().numpy().view(np.uint64)
    total = int(np.dot(per, _slot_factors(pages)))  # uint64 dot wraps mod 2**64
    return (total * dg.buffer_factor(component, buffer)) & dg.MASK, np.unique(pages)


def run_index(starts, counts) -> np.ndarray:
    """Row numbers of runs ``starts[i] .. starts[i] + counts[i] - 1``, concatenated."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]) if len(ends) else 0)
