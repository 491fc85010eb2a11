"""KV-head slicing between prefill and decode TP groups (F4). No SGLang import.

For a non-MLA model every TP rank holds only some KV heads, so when prefill TP
size P differs from decode TP size D each token's KV row has to be cut into
head slices. Stock SGLang got this wrong in three ways (PR #22145, #31968):
it used the per-rank head count (which hides GQA replication when the model
has fewer KV heads H than TP ranks), it mapped replicated decode heads by
modulo instead of integer division, and it tagged KV notifications with the
pipeline rank only, so under PP=1 every prefill rank sent the same key and
decode waited forever.

Head placement follows SGLang's QKV weight sharding: with H >= TP rank r holds
heads [r*H/TP, (r+1)*H/TP); with H < TP each head is replicated on TP/H
consecutive ranks and rank r holds head r // (TP/H).

Which ranks talk to each other follows stock ``_resolve_rank_mapping`` in
``disaggregation/common/conn.py`` (the plugin keeps that bootstrap logic): with
D >= P decode rank d pulls from prefill rank d // (D/P); with D < P it pulls
from the P/D prefill ranks [d*P/D, (d+1)*P/D). When several of those hold the
same replicated head only the lowest-numbered one sends the bytes; the others
still owe decode a completion notification, because stock decode counts one
response per connected prefill rank.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np


class HeadLayoutError(ValueError):
    """A head layout or a head-slice request that cannot be served."""


def _check_positive(name: str, value) -> int:
    # bool is an int subclass; True as a TP size is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise HeadLayoutError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise HeadLayoutError(f"{name} must be positive, got {value}")
    return int(value)


def _check_heads_fit_tp(side: str, tp_size: int, total_kv_heads: int) -> None:
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise HeadLayoutError(
                f"{side} TP size {tp_size} does not divide the {total_kv_heads} KV heads "
                f"({total_kv_heads} % {tp_size} = {total_kv_heads % tp_size})"
            )
    elif tp_size % total_kv_heads:
        raise HeadLayoutError(
            f"{total_kv_heads} KV heads cannot be replicated evenly over {side} TP size "
            f"{tp_size} ({tp_size} % {total_kv_heads} = {tp_size % total_kv_heads})"
        )


def resolve_total_kv_heads(
    total_kv_head_num: Optional[int], kv_head_num_per_rank: int, prefill_tp_size: int
) -> int:
    """Total KV heads of the model; falls back to per-rank count x prefill TP size.

    The fallback is exact only when H >= P: with GQA replication the per-rank
    count is 1 and the product over-counts. Stock SGLang has the same fallback;
    callers should pass ``kv_args.total_kv_head_num`` whenever it exists.
    """
    if total_kv_head_num is not None and not isinstance(total_kv_head_num, bool):
        if int(total_kv_head_num) > 0:
            return int(total_kv_head_num)
    per_rank = _check_positive("kv_head_num (per rank)", kv_head_num_per_rank)
    tp = _check_positive("prefill TP size", prefill_tp_size)
    return per_rank * tp


def head_bytes_from_item_len(item_len: int, page_size: int, heads_per_rank: int) -> int:
    """Bytes of one head of one token (head_dim * dtype_size) from a page item length.

    KV args carry only the per-page item length, not head_dim or dtype; a
    remainder means the layout is not what we think it is, so refuse.
    """
    item_len = _check_positive("item_len", item_len)
    page_size = _check_positive("page_size", page_size)
    heads_per_rank = _check_positive("heads_per_rank", heads_per_rank)
    if item_len % (page_size * heads_per_rank):
        raise HeadLayoutError(
            f"item_len {item_len} is not a multiple of page_size {page_size} x "
            f"heads_per_rank {heads_per_rank}"
        )
    return item_len // (page_size * heads_per_rank)


class HeadSlice(NamedTuple):
    """What one prefill rank writes into one decode rank, in head units."""

    src_head_start: int  # first head to read, relative to the prefill rank's buffer
    dst_head_start: int  # first head to write, relative to the decode rank's buffer
    num_heads: int
    is_sender: bool  # False: a replica; another prefill rank sends these heads

    def byte_range(self, head_bytes: int) -> "HeadSliceBytes":
        """Byte offsets within one token's row (head_bytes = head_dim * dtype_size)."""
        head_bytes = _check_positive("head_bytes", head_bytes)
        return HeadSliceBytes(
            self.src_head_start * head_bytes,
            self.dst_head_start * head_bytes,
            self.num_heads * head_bytes,
        )


class HeadSliceBytes(NamedTuple):
    src_offset: int  # bytes into a prefill token row
    dst_offset: int  # bytes into a decode token row
    length: int


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """KV-head placement for prefill TP size P, decode TP size D and H total KV heads."""

    prefill_tp_size: int
    decode_tp_size: int
    total_kv_heads: int

    def __post_init__(self):
        p = _check_positive("prefill TP size", self.prefill_tp_size)
        d = _check_positive("decode TP size", self.decode_tp_size)
        h = _check_positive("total KV heads", self.total_kv_heads)
        _check_heads_fit_tp("prefill", p, h)
        _check_heads_fit_tp("decode", d, h)
        # Stock bootstrap maps ranks by integer ratio of the two TP sizes.
        if max(p, d) % min(p, d):
            raise HeadLayoutError(
                f"prefill TP size {p} and decode TP size {d}: neither divides the other, "
                f"so decode ranks cannot be mapped onto prefill ranks"
            )

    @property
    def prefill_heads_per_rank(self) -> int:
        return max(1, self.total_kv_heads // self.prefill_tp_size)

    @property
    def decode_heads_per_rank(self) -> int:
        return max(1, self.total_kv_heads // self.decode_tp_size)

    @property
    def prefill_replication(self) -> int:
        """How many prefill ranks hold each head (1 unless H < P)."""
        return max(1, self.prefill_tp_size // self.total_kv_heads)

    @property
    def decode_replication(self) -> int:
        return max(1, self.decode_tp_size // self.total_kv_heads)

    def _check_rank(self, side: str, rank: int, size: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise HeadLayoutError(f"{side} rank must be an int, got {rank!r}")
        if not 0 <= rank < size:
            raise HeadLayoutError(f"{side} rank {rank} out of range for TP size {size}")
        return int(rank)

    def prefill_heads(self, prefill_rank: int) -> range:
        """Global KV heads held by a prefill rank."""
        r = self._check_rank("prefill", prefill_rank, self.prefill_tp_size)
        first = (r // self.prefill_replication) * self.prefill_heads_per_rank
        return range(first, first + self.prefill_heads_per_rank)

    def decode_heads(self, decode_rank: int) -> range:
        """Global KV heads a decode rank holds (and so needs)."""
        r = self._check_rank("decode", decode_rank, self.decode_tp_size)
        first = (r // self.decode_replication) * self.decode_heads_per_rank
        return range(first, first + self.decode_heads_per_rank)

    def prefill_ranks_for_decode(self, decode_rank: int) -> range:
        """Prefill ranks a decode rank connects to (stock bootstrap mapping)."""
        r = self._check_rank("decode", decode_rank, self.decode_tp_size)
        p, d = self.prefill_tp_size, self.decode_tp_size
        if d >= p:
            first = r // (d // p)
            return range(first, first + 1)
        return range(r * (p // d), (r + 1) * (p // d))

    def decode_ranks_for_prefill(self, prefill_rank: int) -> range:
        """Decode ranks a prefill rank serves (inverse of prefill_ranks_for_decode)."""
        r = self._check_rank("prefill", prefill_rank, self.prefill_tp_size)
        p, d = self.prefill_tp_size, self.decode_tp_size
        if d >= p:
            return range(r * (d // p), (r + 1) * (d // p))
        first = r // (p // d)
        return range(first, first + 1)

    def head_slice(self, prefill_rank: int, decode_rank: int) -> HeadSlice:
        """Heads prefill_rank writes into decode_rank, and whether it is the sender."""
        src = self.prefill_heads(prefill_rank)
        dst = self.decode_heads(decode_rank)
        peers = self.prefill_ranks_for_decode(decode_rank)
        if prefill_rank not in peers:
            raise HeadLayoutError(
                f"prefill rank {prefill_rank} does not serve decode rank {decode_rank} "
                f"(P={self.prefill_tp_size}, D={self.decode_tp_size}, "
                f"H={self.total_kv_heads}; its prefill peers are {list(peers)})"
            )
        lo, hi = max(src.start, dst.start), min(src.stop, dst.stop)
        # Peers of a decode rank always cover its heads under the validated
        # divisibility rules; an empty overlap would mean a broken invariant.
        assert lo < hi, (self, prefill_rank, decode_rank)
        # Among this decode rank's peers, replicas of the same heads form
        # aligned blocks of min(replication, peers) ranks; the block's first
        # rank sends.
        block = min(self.prefill_replication, len(peers))
        return HeadSlice(
            src_head_start=lo - src.start,
            dst_head_start=lo - dst.start,
            num_heads=hi - lo,
            is_sender=(prefill_rank - peers.start) % block == 0,
        )


def head_layout_for(prefill_tp_size: int, decode_tp_size: int, total_kv_heads: int, context: str) -> HeadLayout:
    """:class:`HeadLayout`, whose error starts with ``context`` and names the heads and both TP sizes.

    ``context`` says who asks and for what ("nixl-ext", "nixl-ext: SWA state
    (component 0)"), so an operator reading the error knows where it came from.
    """
    try:
        return HeadLayout(prefill_tp_size, decode_tp_size, total_kv_heads)
    except HeadLayoutError as exc:
        raise HeadLayoutError(
            f"{context}: {total_kv_heads} KV heads from prefill TP size {prefill_tp_size} to decode TP size "
            f"{decode_tp_size}: {exc}"
        ) from None


IntArrayLike = Union[Sequence[int], np.ndarray]


def build_head_slice_descriptors(
    src_layer_ptrs: IntArrayLike,
    dst_layer_ptrs: IntArrayLike,
    src_page_indices: IntArrayLike,
    dst_page_indices: IntArrayLike,
    *,
    page_size: int,
    src_item_len: int,
    dst_item_len: int,
    head_slice: HeadSlice,
    head_bytes: int,
) -> np.ndarray:
    """Transfer descriptors for one head slice: an (N, 3) int64 array of rows
    (src address, dst address, length), N = layers x pages x page_size.

    ``*_layer_ptrs`` are the per-layer buffer bases (K layers then V layers, as
    stock does); ``*_item_len`` are bytes per page per layer. Rows are ordered
    layer, page, token, matching stock ``send_kvcache_slice``. Built with a few
    broadcast writes into one preallocated array: at 32K tokens x 128 layer
    buffers that is ~4M rows, so per-layer Python work or concatenation shows.
    """
    page_size = _check_positive("page_size", page_size)
    src_item_len = _check_positive("src_item_len", src_item_len)
    dst_item_len = _check_positive("dst_item_len", dst_item_len)
    for name, item_len in (("src_item_len", src_item_len), ("dst_item_len", dst_item_len)):
        if item_len % page_size:
            raise HeadLayoutError(f"{name} {item_len} is not a multiple of page_size {page_size}")
    src_token_bytes = src_item_len // page_size
    dst_token_bytes = dst_item_len // page_size
    src_offset, dst_offset, length = head_slice.byte_range(head_bytes)
    if length <= 0:
        raise HeadLayoutError(f"head slice {head_slice} sends no bytes")
    if src_offset + length > src_token_bytes:
        raise HeadLayoutError(
            f"head slice bytes [{src_offset}, {src_offset + length}) exceed the prefill "
            f"token row of {src_token_bytes} bytes"
        )
    if dst_offset + length > dst_token_bytes:
        raise HeadLayoutError(
            f"head slice bytes [{dst_offset}, {dst_offset + length}) exceed the decode "
            f"token row of {dst_token_bytes} bytes"
        )

    src_ptrs = np.asarray(src_layer_ptrs, dtype=np.int64).ravel()
    dst_ptrs = np.asarray(dst_layer_ptrs, dtype=np.int64).ravel()
    if src_ptrs.shape != dst_ptrs.shape:
        raise HeadLayoutError(
            f"{src_ptrs.size} prefill layer buffers vs {dst_ptrs.size} decode layer buffers"
        )
    src_pages = np.asarray(src_page_indices, dtype=np.int64).ravel()
    dst_pages = np.asarray(dst_page_indices, dtype=np.int64).ravel()
    if src_pages.shape != dst_pages.shape:
        raise HeadLayoutError(
            f"{src_pages.size} prefill page indices vs {dst_pages.size} decode page indices"
        )
    if src_pages.size and (src_pages.min() < 0 or dst_pages.min() < 0):
        raise HeadLayoutError("negative page index")

    token_in_page = np.arange(page_size, dtype=np.int64)
    # Offsets inside one layer buffer, shared by every layer.
    src_in_layer = (
        src_pages[:, None] * src_item_len + (token_in_page * src_token_bytes + src_offset)
    ).ravel()
    dst_in_layer = (
        dst_pages[:, None] * dst_item_len + (token_in_page * dst_token_bytes + dst_offset)
    ).ravel()

    out = np.empty((src_ptrs.size, src_in_layer.size, 3), dtype=np.int64)
    np.add(src_ptrs[:, None], src_in_layer[None, :], out=out[:, :, 0])
    np.add(dst_ptrs[:, None], dst_in_layer[None, :], out=out[:, :, 1])
    out[:, :, 2] = length
    return out.reshape(-1, 3)


def head_slice_rows(
    layout: "HeadLayout",
    head_slice: HeadSlice,
    what: str,
    src_layer_ptrs: IntArrayLike,
    dst_layer_ptrs: IntArrayLike,
    src_page_indices: IntArrayLike,
    dst_page_indices: IntArrayLike,
    *,
    page_size: int,
    src_item_len: int,
    dst_item_len: Optional[int],
) -> np.ndarray:
    """:func:`build_head_slice_descriptors` after deriving one head's bytes per token from each
    side's page size in bytes and refusing a pair where they differ (``what`` names the pool in
    the error). ``dst_item_len`` None: decode's page size is derived from the layout (a decode
    that registered none)."""
    src_head_bytes = head_bytes_from_item_len(src_item_len, page_size, layout.prefill_heads_per_rank)
    if dst_item_len is None:
        dst_item_len = src_head_bytes * page_size * layout.decode_heads_per_rank
    head_bytes = head_bytes_from_item_len(dst_item_len, page_size, layout.decode_heads_per_rank)
    if src_head_bytes != head_bytes:
        raise HeadLayoutError(
            f"one {what} head is {src_head_bytes} bytes per token on prefill but {head_bytes} on decode"
        )
    return build_head_slice_descriptors(
        src_layer_ptrs, dst_layer_ptrs, src_page_indices, dst_page_indices, page_size=page_size,
        src_item_len=src_item_len, dst_item_len=dst_item_len, head_slice=head_slice, head_bytes=head_bytes,
    )


def transfer_requests(rows: np.ndarray, src_device_id: int, dst_device_id: int):
    """NIXL's (address, length, device id) request arrays of both sides for :func:`head_slice_rows`' rows."""
    n = rows.shape[0]
    src_reqs = np.empty((n, 3), dtype=np.int64)
    dst_reqs = np.empty((n, 3), dtype=np.int64)
    src_reqs[:, 0], src_reqs[:, 1], src_reqs[:, 2] = rows[:, 0], rows[:, 2], src_device_id
    dst_reqs[:, 0], dst_reqs[:, 1], dst_reqs[:, 2] = rows[:, 1], rows[:, 2], dst_device_id
    return src_reqs, dst_reqs


# --- KV-completion notification sender ids (tags: core/nixl_notif.py) ----------

# A sender id packs (pp_rank, engine_rank) into the one integer field stock
# decode already parses. Engine ranks are TP ranks (< TP size, far below this).
ENGINE_RANK_LIMIT = 1 << 16


def notification_sender_id(pp_rank: int, engine_rank: int) -> int:
    """One integer per prefill rank: pp_rank * ENGINE_RANK_LIMIT + engine_rank.

    With pp_rank 0 this is just the engine rank, the value upstream 0.5.12+
    puts in the same field, so PP=1 keys are byte-identical to upstream's.
    """
    for name, value in (("pp_rank", pp_rank), ("engine_rank", engine_rank)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if engine_rank >= ENGINE_RANK_LIMIT:
        raise ValueError(f"engine_rank {engine_rank} >= {ENGINE_RANK_LIMIT}")
    return int(pp_rank) * ENGINE_RANK_LIMIT + int(engine_rank)


# --- F11: which decode a prefill can head-slice for (checked at registration) -----


def check_head_sliced_pair(
    component: str,
    prefill_tp_size: int,
    decode_tp_size: int,
    total_kv_heads: int,
    page_size: int,
    item_lens: Sequence[tuple],
) -> HeadLayout:
    """Refuse a prefill/decode pair whose ``component`` cannot be cut into head slices.

    ``component`` names what is sliced ("KV", "SWA state (component 0)");
    ``item_lens`` lists, per buffer, (prefill item length, decode item length)
    in bytes per page. The pair is servable when the heads fit both TP sizes
    (:class:`HeadLayout`) and every buffer holds whole heads of one size on both
    sides: ``item_len = page_size x heads per rank x head bytes``, with heads per
    rank ``max(1, H // TP)`` as SGLang shards them. The error names the
    component, both TP sizes, the head counts and the first offending buffer.
    """
    p = _check_positive("prefill TP size", prefill_tp_size)
    d = _check_positive("decode TP size", decode_tp_size)
    h = _check_positive("total KV heads", total_kv_heads)
    where = (
        f"{component} cannot be head-sliced from prefill TP {p} to decode TP {d} with {h} KV heads "
        f"({max(1, h // p)} per prefill rank, {max(1, h // d)} per decode rank)"
    )
    try:
        layout = HeadLayout(p, d, h)
        for buf, (src_len, dst_len) in enumerate(item_lens):
            src = _buffer_head_bytes("prefill", buf, src_len, page_size, layout.prefill_heads_per_rank)
            dst = _buffer_head_bytes("decode", buf, dst_len, page_size, layout.decode_heads_per_rank)
            if src != dst:
                raise HeadLayoutError(
                    f"buffer {buf}: one head is {src} bytes per token on prefill but {dst} on decode"
                )
    except HeadLayoutError as exc:
        raise HeadLayoutError(f"{where}: {exc}") from None
    return layout


def _buffer_head_bytes(side: str, buf: int, item_len, page_size: int, heads: int) -> int:
    try:
        return head_bytes_from_item_len(item_len, page_size, heads)
    except HeadLayoutError as exc:
        raise HeadLayoutError(f"{side} buffer {buf}: {exc}") from None
