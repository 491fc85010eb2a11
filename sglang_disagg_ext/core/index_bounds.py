"""Destination-index bounds of a decode peer, and the check of one request against them (F6).

Pure: no SGLang, no torch. SGLang's Mooncake transfer path turns a decode
index into an address as ``buffer_ptr + index * item_len`` for every buffer
of a pool, and never compares the index with the buffer's length; an index
outside the pool makes the engine fail, and stock prefill then blacklists the
whole decode session. Decode knows its pool sizes; stock registration sends
only pointers, so the ``-ext`` decode appends one frame (:func:`encode_frame`)
that stock prefill never reads, and the ``-ext`` prefill checks each request
against it before anything reaches the engine.

Entries of a pool = ``min(data_len // item_len)`` over its buffers: every
buffer is written at the same index, so the smallest bounds them all. The
frame also carries the metadata buffers' row sizes, which F9
(:mod:`.registration_check`) compares with prefill's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Optional, Sequence

from sglang_disagg_ext.core import peer_record

# The frame's prefix; anything else in the trailing position is not ours.
FRAME_PREFIX = b"sglang-disagg-ext:pool-bounds:v1:"

# State kinds whose decode indices are entry indices into every buffer of the
# component (``ptr + index * item_len``), so the bound is exact. Other kinds
# (ring slots, DSA tails, QSA, request rows ...) encode their indices
# differently; they are not checked.
CHECKED_STATE_KINDS = ("swa", "nsa", "dsa", "mamba")


class IndexBoundsError(ValueError):
    """Buffer lists that cannot give a bound, or a malformed bounds frame."""


@dataclasses.dataclass(frozen=True)
class PoolBounds:
    """Entries (pages, aux rows, state slots) each decode pool holds; None: not known."""

    kv: Optional[int]
    aux: Optional[int]
    state: tuple = ()  # one Optional[int] per state component, in registration order
    # Bytes per row of each metadata buffer, in registration order (F9 compares
    # them with prefill's); None: not published (a decode older than F9).
    aux_item_lens: Optional[tuple] = None
    # The decode verifies transfers and, where its status loop takes only
    # stock's three frames (Mooncake up to 0.5.19), reads a digest frame an -ext
    # prefill appends to a Success. Not a bound: the frame is all an -ext decode
    # tells prefill about itself.
    reads_digests: bool = False
    # The decode's compatibility record (F18, :mod:`.peer_record`); None: not published
    # (a stock decode, or an -ext one older than F18).
    peer: Optional[dict] = None


def entries(data_lens: Sequence[int], item_lens: Sequence[int], label: str) -> Optional[int]:
    """Entries every buffer of one pool holds; None when the pool registered no buffers
    (or only empty ones).

    An empty buffer (length 0, item length 0) is a placeholder, not a pool: SGLang
    0.5.23 registers zero-row DSA index-share entries that way so that layer offsets
    stay aligned across peers, and its transfer backends skip them
    (mem_cache/memory_pool.py:5476-5484). It bounds nothing and is left out.
    """
    data_lens, item_lens = list(data_lens or []), list(item_lens or [])
    if not data_lens and not item_lens:
        return None
    if len(data_lens) != len(item_lens):
        raise IndexBoundsError(f"{label}: {len(data_lens)} buffer lengths but {len(item_lens)} item lengths")
    sized = []
    for b, (n, item) in enumerate(zip(data_lens, item_lens)):
        if int(n) == 0 and int(item) == 0:
            continue
        if int(item) <= 0 or int(n) < 0:
            raise IndexBoundsError(f"{label} buffer {b}: length {n}, item length {item}")
        sized.append(int(n) // int(item))
    return min(sized) if sized else None


def bounds_of(
    kv_data_lens: Sequence[int],
    kv_item_lens: Sequence[int],
    aux_data_lens: Sequence[int],
    aux_item_lens: Sequence[int],
    state_data_lens: Sequence[Sequence[int]],
    state_item_lens: Sequence[Sequence[int]],
) -> PoolBounds:
    """Bounds from the per-component lists SGLang's ``KVArgs`` carries (per-component layout)."""
    state_data_lens, state_item_lens = list(state_data_lens or []), list(state_item_lens or [])
    if len(state_data_lens) != len(state_item_lens):
        raise IndexBoundsError(
            f"state: {len(state_data_lens)} components of buffer lengths, {len(state_item_lens)} of item lengths"
        )
    aux = entries(aux_data_lens, aux_item_lens, "aux")
    return PoolBounds(
        kv=entries(kv_data_lens, kv_item_lens, "kv"),
        aux=aux,
        state=tuple(
            entries(d, i, f"state component {c}") for c, (d, i) in enumerate(zip(state_data_lens, state_item_lens))
        ),
        aux_item_lens=None if aux is None else tuple(int(i) for i in aux_item_lens),
    )


def encode_frame(bounds: PoolBounds) -> bytes:
    data = {"kv": bounds.kv, "aux": bounds.aux, "state": list(bounds.state)}
    if bounds.aux_item_lens is not None:  # absent, not null: a frame without it reads as before
        data["aux_item_lens"] = list(bounds.aux_item_lens)
    if bounds.reads_digests:  # absent unless set: older -ext prefills read the frame as before
        data["digests"] = True
    if bounds.peer is not None:  # older -ext prefills ignore keys they do not know
        data["peer"] = bounds.peer
    return FRAME_PREFIX + json.dumps(data).encode()


def _opt_count(value, label: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise IndexBoundsError(f"bounds frame: {label} is {value!r}, not a count")
    return value


def _opt_sizes(value) -> Optional[tuple]:
    if value is None:
        return None
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in value):
        raise IndexBoundsError(f"bounds frame: aux_item_lens is {value!r}, not a list of row sizes")
    return tuple(value)


def decode_frame(frame: bytes) -> Optional[PoolBounds]:
    """The bounds in ``frame``; None when it is not a bounds frame. Raises on a malformed one."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or not bytes(frame).startswith(FRAME_PREFIX):
        return None
    try:
        data = json.loads(bytes(frame)[len(FRAME_PREFIX):].decode())
    except ValueError as exc:
        raise IndexBoundsError(f"bounds frame is not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("state", []), list):
        raise IndexBoundsError(f"bounds frame: unexpected content {data!r}")
    return PoolBounds(
        kv=_opt_count(data.get("kv"), "kv"),
        aux=_opt_count(data.get("aux"), "aux"),
        state=tuple(_opt_count(v, f"state component {c}") for c, v in enumerate(data.get("state", []))),
        aux_item_lens=_opt_sizes(data.get("aux_item_lens")),
        reads_digests=data.get("digests") is True,
        peer=peer_record.parse(data.get("peer")),
    )


def bounds_in_message(frames: Sequence[bytes]) -> Optional[PoolBounds]:
    """The bounds a registration message carries in its last frame, or None (a stock peer)."""
    return decode_frame(frames[-1]) if frames else None


def _first_outside(indices, n: int) -> Optional[tuple]:
    """(position, index) of the first index not in [0, n), or None.

    Runs on the scheduler thread for every chunk: a numpy array (what SGLang
    passes) is bounded by its own min/max first, the walk only runs on a miss.
    """
    lo, hi = getattr(indices, "min", None), getattr(indices, "max", None)
    if callable(lo) and callable(hi) and len(indices) and 0 <= int(lo()) and int(hi()) < n:
        return None
    for pos, idx in enumerate(indices):
        if not 0 <= int(idx) < n:
            return pos, int(idx)
    return None


def _reason(what: str, pos: Optional[int], count: Optional[int], idx: int, n: int, unit: str) -> str:
    where = f" (position {pos} of {count})" if pos is not None else ""
    return f"{what}: destination index {idx}{where} outside decode's pool of {n} {unit} (valid 0..{n - 1})"


def check_destination(
    bounds: PoolBounds,
    kv_indices: Optional[Sequence[int]],
    aux_index: Optional[int],
    state_indices: Optional[Sequence[Optional[Sequence[int]]]],
    state_kinds: Sequence[str] = (),
) -> Optional[str]:
    """Why this request's decode indices cannot be written (the first bad one), or None.

    ``state_kinds[i]`` names component ``i``; only :data:`CHECKED_STATE_KINDS`
    are checked, and only where decode published that component's bound.
    """
    if bounds.kv is not None and kv_indices is not None:
        hit = _first_outside(kv_indices, bounds.kv)
        if hit:
            return _reason("kv", hit[0], len(kv_indices), hit[1], bounds.kv, "pages")
    if bounds.aux is not None and aux_index is not None and not 0 <= int(aux_index) < bounds.aux:
        return _reason("aux", None, None, int(aux_index), bounds.aux, "rows")
    kinds: List[str] = [str(k) for k in state_kinds]
    for c, pages in enumerate(state_indices or []):
        if pages is None or c >= len(bounds.state) or bounds.state[c] is None:
            continue
        kind = kinds[c] if c < len(kinds) else "?"
        if kind not in CHECKED_STATE_KINDS:
            continue
        pages = list(pages)
        hit = _first_outside(pages, bounds.state[c])
        if hit:
            return _reason(f"state component {c} ({kind})", hit[0], len(pages), hit[1], bounds.state[c], "entries")
    return None
