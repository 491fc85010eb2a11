"""Byte patterns and the expected decode contents, derived by hand. numpy only.

Prefill fills every byte of every pool (KV, aux rows, state components) with a
deterministic pattern that depends on (pool id, buffer, page, byte offset), so
a page that lands in the wrong place, or a page from the wrong buffer, is
recognisable. Decode fills every byte with :data:`SENTINEL`; pattern bytes never
equal it, so "untouched" is "every byte is the sentinel".

What decode must hold after a request is derived here from the scenario alone,
by the rules SGLang's transfer path is meant to follow (never by calling the
plugin's code under test):

* KV pages, paged state components (swa, nsa, dsv4): the two page lists are
  aligned on their leading entries, the first ``min(len(src), len(dst))``
  pairs move (page ``src[i]`` -> page ``dst[i]``), the rest of the longer list
  is left alone (fix F1's rule). A ``None`` list moves nothing.
* Mamba: one slot to one slot; anything but exactly one slot on each side
  moves nothing.
* Aux: the request's prefill row -> its decode row, in every aux buffer (a
  KV-checksum buffer only decode has receives nothing).

After request ``k`` the pages it targets must hold those source bytes; every
other page must hold what the last request that targeted it left there: an
earlier request whose bytes decode held (Success, every byte right at its own
check) leaves its source bytes, and a page no request ``0 .. k`` targets still
holds the sentinel. So a stray write into an earlier request's page is seen at
the request that made it. Only a page whose last writer did not succeed (or
whose bytes were already wrong) holds nothing derivable, and is not checked.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .scenario import AUX_POOL_ID, KV_POOL_ID, MISMATCHED_PEER, PAGED_STATE_KINDS, STATE_POOL_BASE, Scenario

SENTINEL = 0xA5
_M64 = (1 << 64) - 1

# Cap on mismatch lines per buffer, so one broken transfer cannot flood a report.
MAX_MISMATCHES_PER_BUFFER = 8


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


def _seed(pool_id: int, buffer: int) -> int:
    return ((pool_id + 1) * 0x9E3779B97F4A7C15 ^ (buffer + 1) * 0xD1B54A32D192ED03) & _M64


def _pattern(pool_id: int, buffer: int, pages: np.ndarray, nbytes: int) -> np.ndarray:
    pages = np.asarray(pages, dtype=np.uint64).reshape(-1, 1)
    offs = np.arange(nbytes, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        x = np.uint64(_seed(pool_id, buffer)) + pages * np.uint64(0x8CB92BA72F3D8DD7)
        x = _mix64(x) + offs * np.uint64(0x9E3779B97F4A7C15)
    out = (_mix64(x) >> np.uint64(56)).astype(np.uint8)
    out[out == SENTINEL] = SENTINEL ^ 0xFF
    return out


def page_bytes(pool_id: int, buffer: int, page: int, nbytes: int) -> np.ndarray:
    """The source bytes of one page (or aux row, or Mamba slot): uint8[nbytes]."""
    return _pattern(pool_id, buffer, np.array([page]), nbytes)[0]


def buffer_pattern(pool_id: int, buffer: int, num_pages: int, item_bytes: int) -> np.ndarray:
    """A whole source buffer: uint8[num_pages, item_bytes]."""
    return _pattern(pool_id, buffer, np.arange(num_pages), item_bytes)


def host_bytes(actual) -> np.ndarray:
    """A buffer as uint8 numpy, wherever it lives.

    A torch tensor (CPU or GPU: anything with ``detach`` and ``cpu``) is
    copied to host memory first; numpy input is taken as it is. Duck-typed so
    this module needs no torch.
    """
    if hasattr(actual, "detach") and hasattr(actual, "cpu"):
        actual = actual.detach().cpu().numpy()
    return np.asarray(actual, dtype=np.uint8)


def sentinel_buffer(num_pages: int, item_bytes: int) -> np.ndarray:
    return np.full((num_pages, item_bytes), SENTINEL, dtype=np.uint8)


# -- expected contents ---------------------------------------------------------


def aligned_pairs(src: Optional[Sequence[int]], dst: Optional[Sequence[int]]) -> List[Tuple[int, int]]:
    """(src page, dst page) pairs: the first min(len) entries, in order."""
    if src is None or dst is None:
        return []
    n = min(len(src), len(dst))
    return [(int(src[i]), int(dst[i])) for i in range(n)]


def mamba_pairs(src: Optional[Sequence[int]], dst: Optional[Sequence[int]]) -> List[Tuple[int, int]]:
    """One slot to one slot; any other shape moves nothing."""
    if src is None or dst is None or len(src) != 1 or len(dst) != 1:
        return []
    return [(int(src[0]), int(dst[0]))]


@dataclasses.dataclass
class PoolExpectation:
    """What one pool on decode must look like after one request.

    ``writes`` maps a decode page to the prefill page whose bytes this request
    must have put there; ``kept`` maps a decode page an earlier request wrote,
    and no later one targeted, to (that request, its prefill page): the bytes it
    must still hold; ``sentinel_pages`` must still hold the sentinel. Pages in
    none of them are not checked (their last writer did not succeed).
    """

    pool_id: int
    name: str
    num_pages: int
    writes: Dict[int, int]
    sentinel_pages: List[int]
    kept: Dict[int, Tuple[int, int]] = dataclasses.field(default_factory=dict)


def _writes(pairs: List[Tuple[int, int]]) -> Dict[int, int]:
    out: Dict[int, int] = {}
    for s, d in pairs:
        out[d] = s  # a repeated decode page: the later pair is the last write
    return out


def request_pairs(scn: Scenario, index: int) -> Dict[int, List[Tuple[int, int]]]:
    """Pool id -> (src, dst) pairs request ``index`` must move."""
    req = scn.requests[index]
    out = {
        KV_POOL_ID: aligned_pairs(req.src_kv_pages, req.dst_kv_pages),
        AUX_POOL_ID: [(req.aux_index, req.decode_aux_index)],
    }
    for c, st in enumerate(req.state):
        if st.kind in PAGED_STATE_KINDS:
            pairs = aligned_pairs(st.src_pages, st.dst_pages)
        else:
            pairs = mamba_pairs(st.src_pages, st.dst_pages)
        out[STATE_POOL_BASE + c] = pairs
    return out


def _targeted(scn: Scenario, index: int) -> Dict[int, set]:
    """Pool id -> decode pages request ``index`` writes (the dst side of its pairs)."""
    return {pid: {d for _, d in pairs} for pid, pairs in request_pairs(scn, index).items()}


def pool_names(scn: Scenario) -> Dict[int, Tuple[str, int]]:
    """Pool id -> (name, number of pages/rows/slots)."""
    out = {KV_POOL_ID: ("kv", scn.kv.num_pages), AUX_POOL_ID: ("aux", scn.aux_rows)}
    for c, pool in enumerate(scn.state_pools):
        out[STATE_POOL_BASE + c] = (f"state{c}:{pool.kind}", pool.num_pages)
    return out


def expected_after_request(
    scn: Scenario, index: int, held: Optional[Collection[int]] = None
) -> Dict[int, PoolExpectation]:
    """Pool id -> what decode must hold right after request ``index`` ends.

    ``held``: the earlier requests whose bytes decode holds (decode Success with
    every byte right at its own check); None: every earlier request. A page's
    expected content is its last writer's: request ``index`` itself (``writes``),
    else the last earlier request that targeted it if that one is held
    (``kept``), else unknown if that one is not (a failed request may have
    written part of its pages); a page nobody targeted keeps the sentinel.
    """
    names = pool_names(scn)
    # Pool id -> decode page -> (request, prefill page) of its last writer, None where
    # that writer is not held: replayed request by request, as decode saw them.
    last: Dict[int, Dict[int, Optional[Tuple[int, int]]]] = {pid: {} for pid in names}
    for k in range(index):
        ok = held is None or k in held
        for pid, pairs in request_pairs(scn, k).items():
            for d, s in _writes(pairs).items():
                last[pid][d] = (k, s) if ok else None
    pairs = request_pairs(scn, index)
    out = {}
    for pid, (name, n) in names.items():
        # An out-of-pool decode index (``allow_out_of_pool``) names no page
        # decode has: nothing to expect there.
        writes = {d: s for d, s in _writes(pairs.get(pid, [])).items() if 0 <= d < n}
        kept = {d: ks for d, ks in sorted(last[pid].items()) if ks is not None and d not in writes and 0 <= d < n}
        sentinel = [p for p in range(n) if p not in last[pid] and p not in writes]
        out[pid] = PoolExpectation(pid, name, n, writes, sentinel, kept)
    return out


def wave_expectations(
    scn: Scenario, statuses: Dict[int, Optional[str]]
) -> Tuple[Dict[int, Dict[int, PoolExpectation]], Dict[int, PoolExpectation]]:
    """What decode must hold after a wave (``Scenario.wave``) whose decode statuses are
    ``statuses`` (request index -> KVPoll name), starting from all-sentinel pools.

    Returns (per room, untargeted): for each request that ended Success, pool id ->
    its writes (nothing else checked there); and pool id -> every page no request
    of the wave targets, which must still hold the sentinel. Pages of a request that
    did not succeed are in neither: what landed there before it failed is not checked;
    with ``scn.shared_rooms`` those of a request whose room an earlier request of the scenario
    names are untargeted (a refused duplicate must write nothing), and so are those of a
    request for the mismatched decode that did not succeed (a refused peer's).
    """
    names = pool_names(scn)
    per_room: Dict[int, Dict[int, PoolExpectation]] = {}
    targeted: Dict[int, set] = {pid: set() for pid in names}
    first_of_room: Dict[int, int] = {}
    if scn.shared_rooms:
        for i in range(len(scn.requests)):
            first_of_room.setdefault(scn.room_of(i), i)
    for index, status in statuses.items():
        pairs = request_pairs(scn, index)
        refused = ((scn.shared_rooms and first_of_room[scn.room_of(index)] != index)
                   or scn.requests[index].fault == MISMATCHED_PEER)
        if status == "Success" or not refused:
            for pid, pages in _targeted(scn, index).items():
                targeted[pid] |= pages
        if status != "Success":
            continue
        per_room[index] = {}
        for pid, (name, n) in names.items():
            writes = {d: s for d, s in _writes(pairs.get(pid, [])).items() if 0 <= d < n}
            per_room[index][pid] = PoolExpectation(pid, name, n, writes, [])
    untargeted = {
        pid: PoolExpectation(pid, name, n, {}, [p for p in range(n) if p not in targeted[pid]])
        for pid, (name, n) in names.items()
    }
    return per_room, untargeted


def source_buffer(
    scn: Scenario, pool_id: int, decode_buffer: int, decode_buffers: Optional[int] = None
) -> Tuple[Optional[int], List[int]]:
    """(prefill buffer that decode buffer ``decode_buffer`` of pool ``pool_id`` receives, or
    None for a decode-only layer; every prefill buffer of that pool, to name misplaced bytes).

    Only a paged state pool with ``decode_extra_layers`` differs from "the same
    index": prefill has ``n`` layers (K0..K(n-1), V0..V(n-1)), decode ``m = n +
    extra`` (K0..K(m-1), V0..V(m-1)); prefill layer L belongs in decode layer L
    and decode layers n..m-1 receive nothing. And the aux pool with
    ``kv_checksum_on == "decode"``: decode's last buffer (of ``decode_buffers``)
    is the checksum buffer prefill does not have, so it receives nothing.
    """
    if pool_id == AUX_POOL_ID and scn.kv_checksum_on == "decode" and decode_buffers is not None:
        return (None, []) if decode_buffer == decode_buffers - 1 else (decode_buffer, [])
    c = pool_id - STATE_POOL_BASE
    if c < 0 or c >= len(scn.state_pools) or not scn.state_pools[c].decode_extra_layers:
        return decode_buffer, []
    n = scn.state_pools[c].num_layers
    m = n + scn.state_pools[c].decode_extra_layers
    kv, layer = divmod(decode_buffer, m)
    src = kv * n + layer if layer < n else None
    return src, list(range(2 * n))


def untouched(expectation: PoolExpectation) -> PoolExpectation:
    """The same pool with nothing written: every page must hold the sentinel."""
    return dataclasses.replace(expectation, writes={}, kept={}, sentinel_pages=list(range(expectation.num_pages)))


# -- comparison ----------------------------------------------------------------


def _identify(
    actual_page: np.ndarray, pool_id: int, buffer: Optional[int], num_pages: int, others: Sequence[int] = ()
) -> str:
    if np.all(actual_page == SENTINEL):
        return "the sentinel (never written)"
    for b in ([buffer] if buffer is not None else []) + [o for o in others if o != buffer]:
        candidates = buffer_pattern(pool_id, b, num_pages, actual_page.size)
        hits = np.nonzero(np.all(candidates == actual_page[None, :], axis=1))[0]
        if hits.size:
            where = "" if b == buffer else f"buffer {b} "
            return f"prefill {where}page {int(hits[0])}'s bytes"
    n_sent = int(np.count_nonzero(actual_page == SENTINEL))
    return f"unrecognised bytes ({n_sent}/{actual_page.size} bytes still sentinel)"


def dirty_sentinel_pages(actual: np.ndarray, expectation: PoolExpectation) -> List[int]:
    """Pages that must still hold the sentinel but do not (uint8[num_pages, item_bytes])."""
    if not expectation.sentinel_pages:
        return []
    rows = np.asarray(expectation.sentinel_pages, dtype=np.int64)
    return rows[~np.all(actual[rows] == SENTINEL, axis=1)].tolist()


def compare_buffer(
    actual: np.ndarray,
    pool_id: int,
    buffer: Optional[int],
    expectation: PoolExpectation,
    label: str,
    src_num_pages: Optional[int] = None,
    identify_buffers: Sequence[int] = (),
) -> List[str]:
    """Check one decode buffer (uint8[num_pages, item_bytes], numpy or a tensor on any device); return mismatch lines.

    ``buffer`` is the prefill buffer whose pages this one must receive (None:
    none, ``expectation`` then has no writes); wrong bytes are named after
    ``buffer`` or, failing that, one of the prefill buffers ``identify_buffers``.
    """
    actual = host_bytes(actual)
    n_src = src_num_pages if src_num_pages is not None else expectation.num_pages
    item = actual.shape[1]
    problems: List[str] = []
    skipped = 0

    def add(msg):
        nonlocal skipped
        if len(problems) < MAX_MISMATCHES_PER_BUFFER:
            problems.append(msg)
        else:
            skipped += 1

    for dst, src in sorted(expectation.writes.items()):
        want = page_bytes(pool_id, buffer, src, item)
        got = actual[dst]
        if not np.array_equal(got, want):
            bad = np.nonzero(got != want)[0]
            add(
                f"{label} page {dst}: expected prefill page {src}'s bytes, found "
                f"{_identify(got, pool_id, buffer, n_src, identify_buffers)} ({bad.size}/{item} bytes differ, "
                f"first at offset {int(bad[0])})"
            )
    for p in dirty_sentinel_pages(actual, expectation):
        add(f"{label} page {p}: must be untouched, found {_identify(actual[p], pool_id, buffer, n_src, identify_buffers)}")
    for dst, (k, src) in changed_kept_pages(actual, pool_id, buffer, expectation):
        bad = np.nonzero(actual[dst] != page_bytes(pool_id, buffer, src, item))[0]
        add(
            f"{label} page {dst}: must still hold request {k}'s bytes (prefill page {src}), found "
            f"{_identify(actual[dst], pool_id, buffer, n_src, identify_buffers)} ({bad.size}/{item} bytes differ, "
            f"first at offset {int(bad[0])})"
        )
    if skipped:
        problems.append(f"{label}: {skipped} more mismatching pages not listed")
    return problems


def changed_kept_pages(
    actual: np.ndarray, pool_id: int, buffer: Optional[int], expectation: PoolExpectation
) -> List[Tuple[int, Tuple[int, int]]]:
    """(decode page, (request, prefill page)) of each page of ``expectation.kept`` that no
    longer holds that request's bytes (uint8[num_pages, item_bytes]); ``buffer`` as in
    :func:`compare_buffer`. One pattern evaluation for all of them."""
    if not expectation.kept or buffer is None:
        return []
    dst = np.asarray(list(expectation.kept), dtype=np.int64)
    src = np.asarray([s for _, s in expectation.kept.values()], dtype=np.int64)
    want = _pattern(pool_id, buffer, src, actual.shape[1])
    changed = ~np.all(actual[dst] == want, axis=1)
    return [(int(d), expectation.kept[int(d)]) for d in dst[changed].tolist()]


# -- KV heads over several TP ranks (multi-rank scenarios) ----------------------
#
# A page of a KV buffer is ``page_size`` token rows; a token row is the heads a
# rank holds, ``head_bytes`` each. The *model's* page of buffer ``b`` (all H
# heads, token-major then head) is ``page_bytes(KV_POOL_ID, b, page, page_size
# * H * head_bytes)``; a rank's page is that page with only its heads kept. So a
# rank holding every head (TP 1) has exactly the single-rank pattern, replicas
# of a head hold identical bytes on every rank, and the bytes decode must hold
# follow from which global heads each rank holds. Head placement below is
# SGLang's QKV weight sharding, written out independently of the plugin:
# H >= TP: rank r holds heads [r*H/TP, (r+1)*H/TP); H < TP: each head is on
# TP/H consecutive ranks, rank r holds head r // (TP/H). A paged state pool
# (an SWA window cache) is attention KV too: the same rules with its own pool
# id and head count (``pool_id`` below).


def rank_kv_heads(total_heads: int, tp_size: int, rank: int) -> List[int]:
    """Global KV heads held by TP rank ``rank`` (raises for a layout SGLang cannot shard)."""
    if total_heads < 1 or tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"bad layout: {total_heads} heads, TP {tp_size}, rank {rank}")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} heads do not split over TP {tp_size}")
        per = total_heads // tp_size
        return list(range(rank * per, (rank + 1) * per))
    if tp_size % total_heads:
        raise ValueError(f"{total_heads} heads do not replicate evenly over TP {tp_size}")
    return [rank // (tp_size // total_heads)]


def heads_per_rank(total_heads: int, tp_size: int) -> int:
    """KV heads in one rank's pool (SGLang: ``max(1, H // TP)``)."""
    return max(1, total_heads // tp_size)


def kv_rank_pages(
    buffer: int,
    pages: Sequence[int],
    page_size: int,
    total_heads: int,
    head_bytes: int,
    heads: Sequence[int],
    pool_id: int = KV_POOL_ID,
) -> np.ndarray:
    """uint8[len(pages), page_size * len(heads) * head_bytes]: those pages as a rank holding ``heads`` has them."""
    full = _pattern(pool_id, buffer, np.asarray(pages), page_size * total_heads * head_bytes)
    full = full.reshape(len(pages), page_size, total_heads, head_bytes)
    return np.ascontiguousarray(full[:, :, list(heads), :]).reshape(len(pages), -1)


def kv_rank_buffer(
    buffer: int,
    num_pages: int,
    page_size: int,
    total_heads: int,
    head_bytes: int,
    heads: Sequence[int],
    pool_id: int = KV_POOL_ID,
) -> np.ndarray:
    """A whole KV buffer of one rank: uint8[num_pages, page_size * len(heads) * head_bytes]."""
    return kv_rank_pages(buffer, range(num_pages), page_size, total_heads, head_bytes, heads, pool_id)


def compare_kv_rank_buffer(
    actual: np.ndarray,
    buffer: int,
    expectation: PoolExpectation,
    *,
    num_layers: int,
    page_size: int,
    total_heads: int,
    head_bytes: int,
    heads: Sequence[int],
    dtype_size: int,
    label: str,
    pool_id: int = KV_POOL_ID,
) -> List[str]:
    """Check one decode KV buffer of a multi-rank run; return mismatch lines.

    Every written element is compared; a wrong element is reported as
    (K/V, layer, page, token, global head, dim) with what it holds instead.
    """
    actual = host_bytes(actual)
    kv, layer = ("K", buffer) if buffer < num_layers else ("V", buffer - num_layers)
    problems: List[str] = []
    skipped = 0

    def add(msg):
        nonlocal skipped
        if len(problems) < MAX_MISMATCHES_PER_BUFFER:
            problems.append(msg)
        else:
            skipped += 1

    if expectation.writes:
        dst = np.asarray(sorted(expectation.writes), dtype=np.int64)
        src = [expectation.writes[d] for d in dst.tolist()]
        want = kv_rank_pages(buffer, src, page_size, total_heads, head_bytes, heads, pool_id)
        got = actual[dst]
        if got.shape != want.shape:
            return [f"{label}: page rows of {got.shape[1]} bytes, expected {want.shape[1]}"]
        shape = (len(dst), page_size, len(heads), head_bytes)
        bad = np.argwhere(got.reshape(shape) != want.reshape(shape))
        seen = set()
        for i, tok, h, byte in bad.tolist():
            key = (i, tok, h, byte // dtype_size)
            if key in seen:
                continue
            seen.add(key)
            lo, hi = (byte // dtype_size) * dtype_size, (byte // dtype_size + 1) * dtype_size
            cell = got.reshape(shape)[i, tok, h, lo:hi]
            exp = want.reshape(shape)[i, tok, h, lo:hi]
            what = "the sentinel" if np.all(cell == SENTINEL) else f"0x{cell.tobytes().hex()}"
            add(
                f"{label} ({kv} layer {layer}) page {int(dst[i])} token {tok} head {heads[h]} dim "
                f"{byte // dtype_size}: expected prefill page {src[i]}'s element 0x{exp.tobytes().hex()}, "
                f"found {what}"
            )
    for p in dirty_sentinel_pages(actual, expectation):
        add(f"{label} ({kv} layer {layer}) page {p}: must be untouched, found written bytes")
    if expectation.kept:
        dst = np.asarray(list(expectation.kept), dtype=np.int64)
        src = [s for _, s in expectation.kept.values()]
        want = kv_rank_pages(buffer, src, page_size, total_heads, head_bytes, heads, pool_id)
        got = actual[dst]
        if got.shape != want.shape:
            return problems + [f"{label}: page rows of {got.shape[1]} bytes, expected {want.shape[1]}"]
        for i in np.nonzero(~np.all(got == want, axis=1))[0].tolist():
            k, s = expectation.kept[int(dst[i])]
            what = "the sentinel" if np.all(got[i] == SENTINEL) else "other bytes"
            bad = np.nonzero(got[i] != want[i])[0]
            add(
                f"{label} ({kv} layer {layer}) page {int(dst[i])}: must still hold request {k}'s bytes (prefill "
                f"page {s}), found {what} ({bad.size}/{got.shape[1]} bytes differ, first at offset {int(bad[0])})"
            )
    if skipped:
        problems.append(f"{label}: {skipped} more mismatching elements not listed")
    return problems
