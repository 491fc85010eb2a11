"""Verified transfers: the engine-independent half, shared by ``mooncake-ext`` and ``nixl-ext``.

Switch: ``SGLANG_DISAGG_EXT_VERIFY=1`` in the scheduler's environment, read
once when the backend composes its class and once per manager.

Prefill: each engine's adapter hands every write it is about to give the engine
to :meth:`VerifiedTransferMixin._verify_add_blocks` as ``(src, dst, length)``
blocks for one decode session (Mooncake: ``_transfer_data``,
``mooncake.verify``; NIXL: the descriptor lists of each transfer it creates,
``nixl.verify``). Before the engine reads them, each block's source bytes are
digested at their *destination* placement (``core.digest``: component, decode
buffer, decode page, word offset), on the pool's own device (numpy on CPU; on
CUDA one fused Triton kernel, or torch kernels where Triton is missing; one call
per group of buffers per transfer), and added to the room's partial for that
decode session. The room is known from the chunk the transfer worker took from
its queue. When the room's Success goes to a decode endpoint
(``send_kv_status_message``, SGLang's common status codec), the partial travels
as one trailing frame after the reason frame: stock ``parse_kv_status_message``
reads frames by position and ignores it, so a stock decode is unaffected (no
extra message, no round trip).

Decode: ``parse_kv_status_message`` keeps the frame of each prefill rank's
Success; when stock then moves the room to Success (every expected rank
reported), ``update_status`` first recomputes the digest over the listed
decode pages and compares it with the sum of the ranks' partials, per
(component, buffer). A mismatch ends the room Failed with a reason naming the
component, buffer and source rank(s) and is counted
(``verify_mismatches_total{component}``). Prefill has already concluded the
room as Success (and released its pages), so it is told for the record: its Success
carries one more trailing frame with its bootstrap address, and decode sends a notice
there naming room, decode rank and reason (from a PUSH socket of its own, per thread);
prefill logs it and counts ``verify_mismatch_reports_total``. Where stock's bootstrap
loop hands decode's messages to ``_handle_abort_notification`` first (NIXL 0.5.19+,
Mooncake 0.5.22+, ``releases.stock_bootstrap_reads_notices``) the notice is taken
there; elsewhere each adapter starts stock's bootstrap thread on a socket filter that
takes it (:meth:`VerifiedTransferMixin._verify_listen_for_notices`).

A room is left unverified (counted as ``verified_transfers_total{result="unverified"}``,
never failed) when some source rank sent no frame (a stock or non-verifying
prefill) or when a prefill block could not be placed in a registered buffer
(prefill then sends no frame for that room). Writes the adapter does not see
are not covered: their pages are simply not listed (see each adapter).

Needs the common status codec on both sides: where a release's decode learns
Success another way, the backend does not compose the mixin
(``verification.available`` says why).
"""

from __future__ import annotations

import ctypes
import logging
import itertools
import threading
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import zmq

from sglang_disagg_ext import metrics, releases
from sglang_disagg_ext.verification import VERIFY_ENV
from sglang_disagg_ext.verification import enabled as verify_enabled
from sglang_disagg_ext.verification import required as verify_required
from sglang_disagg_ext.backends.common.shared import FilteringSocket
from sglang_disagg_ext.backends.common.digest_kernels import run_index, rows_digests, span_digest, span_digests
from sglang_disagg_ext.core import digest as dg
from sglang_disagg_ext.core.aux_rows import aux_row_blocks

logger = logging.getLogger("sglang_disagg_ext.verify")

_SUCCESS = 4  # KVPoll.Success (IntEnum, same value on every supported release)
_FAILED = 0
STAGING_COMPONENT = -1  # decode's staging ring in its buffer table (never digested)
# Prefill's address for decode's mismatch notice: a trailing frame after the digest frame
# ("host|port" of prefill's bootstrap socket), sent where that socket's loop takes decode's
# notices (stock's from releases.stock_bootstrap_reads_notices, else the -ext filter).
REPLY_MAGIC = b"SDXR1"
NOTICE_TAG = b"SDXV_MISMATCH"  # decode -> prefill: [tag, room, decode rank, reason]


# -- tensors over registered buffers --------------------------------------------


class _CudaArray:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _bytes_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` at ``ptr`` on ``device``, no copy."""
    if device.type == "cuda":
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)))


class _Buffer:
    __slots__ = ("start", "end", "component", "index", "item_len", "_device", "_flat", "_rows")

    def __init__(self, start, nbytes, component, index, item_len, device):
        self.start, self.end = int(start), int(start) + int(nbytes)
        self.component, self.index, self.item_len = component, index, int(item_len)
        self._device = device
        self._flat = None
        self._rows = None

    def flat(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = _bytes_at(self.start, self.end - self.start, self._device)
        return self._flat

    def rows(self):
        """The buffer's whole items as ``(items, item_len)`` uint8 rows, made once: a NumPy
        array for a host buffer whose items the CPU kernel takes as they are (whole 8-byte
        words), else a tensor on the buffer's device."""
        if self._rows is None:
            n = (self.end - self.start) // self.item_len
            rows = self.flat()[: n * self.item_len].view(n, self.item_len)
            if rows.device.type == "cpu" and self.item_len % dg.WORD_BYTES == 0:
                rows = rows.numpy()
            self._rows = rows
        return self._rows


def state_lists(values) -> List[List[int]]:
    """State pointers/lengths per component: list-of-lists (0.5.12+) or one flat list (older)."""
    values = list(values or [])
    if values and isinstance(values[0], (list, tuple)):
        return [list(v or []) for v in values]
    return [values] if values else []


def _local_buffers(kv_args, device) -> List[_Buffer]:
    out = []

    def add(component, ptrs, lens, items):
        for b, (p, n, i) in enumerate(zip(ptrs or [], lens or [], items or [])):
            if p and n and i:
                out.append(_Buffer(p, n, component, b, i, device))

    add(dg.KV_COMPONENT, kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens)
    add(dg.AUX_COMPONENT, kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens)
    ptrs = state_lists(getattr(kv_args, "state_data_ptrs", None))
    lens = state_lists(getattr(kv_args, "state_data_lens", None))
    items = state_lists(getattr(kv_args, "state_item_lens", None))
    for i, (p, n, it) in enumerate(zip(ptrs, lens, items)):
        add(dg.STATE_COMPONENT_BASE + i, p, n, it)
    out.sort(key=lambda b: b.start)
    return out


def _block_array(blocks) -> np.ndarray:
    """``(src, dst, length)`` blocks as an ``N x 3`` int64 array. Mooncake hands a list of
    tuples, which ``np.fromiter`` reads in half ``np.asarray``'s time (a fragmented request
    has hundreds)."""
    if isinstance(blocks, list):
        try:
            return np.fromiter(itertools.chain.from_iterable(blocks), dtype=np.int64,
                               count=3 * len(blocks)).reshape(-1, 3)
        except (TypeError, ValueError):
            pass  # not all 3-tuples: as any other sequence
    return np.asarray(blocks, dtype=np.int64).reshape(-1, 3)


_TABLE_ARRAYS: Dict[int, Tuple[List[_Buffer], Tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}


def _table_arrays(table: List[_Buffer]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, item lengths) of a sorted buffer table as int64 arrays, cached per table
    (the table itself is kept in the cache, so its id is not reused while cached)."""
    hit = _TABLE_ARRAYS.get(id(table))
    if hit is not None and hit[0] is table:
        return hit[1]
    arrays = (np.array([b.start for b in table], dtype=np.int64),
              np.array([min(b.end, (1 << 63) - 1) for b in table], dtype=np.int64),
              np.array([b.item_len for b in table], dtype=np.int64))
    if len(_TABLE_ARRAYS) > 256:  # one per decode session and one local: bounded anyway
        _TABLE_ARRAYS.clear()
    _TABLE_ARRAYS[id(table)] = (table, arrays)
    return arrays


class RoomQueue:
    """A transfer queue as its worker sees it: ``get`` notes the room of the chunk it returns."""

    def __init__(self, queue, owner, room_of=None):
        self._queue = queue
        self._owner = owner
        self._room_of = room_of or (lambda item: getattr(item, "room", None))

    def get(self, *args, **kwargs):
        self._owner._verify_tls.room = None
        item = self._queue.get(*args, **kwargs)
        room = self._room_of(item)
        self._owner._verify_tls.room = room
        if room is not None:
            for session in list(self._owner.transfer_infos.get(room, {}) or {}):
                self._owner._verify_session_room[session] = room
        return item

    def __getattr__(self, name):  # put (staging re-enqueue), qsize, ...
        return getattr(self._queue, name)


class _Partial:
    """One room's digest for one decode session, as prefill builds it chunk by chunk."""

    __slots__ = ("digests", "pages", "unplaced")

    def __init__(self):
        self.digests: Dict[Tuple[int, int], int] = {}
        self.pages: Dict[int, set] = {}
        self.unplaced: Optional[str] = None

    def unverifiable(self, room, decode: str) -> bool:
        """True, with a warning naming the room, the decode and why, where a block of it could
        not be placed (the room then goes unverified: no digest is sent for it)."""
        if self.unplaced is None:
            return False
        logger.warning("room %s: not verifiable for decode %s (%s); no digest sent", room, decode, self.unplaced)
        return True

    def add(self, component, buffer, value, pages):
        key = (component, buffer)
        self.digests[key] = (self.digests.get(key, 0) + value) & dg.MASK
        if isinstance(pages, np.ndarray):
            pages = pages.tolist()
        self.pages.setdefault(component, set()).update(pages)


def recorded_attribute(key: str, wrap, doc: str) -> property:
    """A property for the engine object SGLang's constructor assigns (NIXL's ``agent``, MoRI's
    ``engine``): with verification on, the value is stored as ``wrap(manager, value)``, so every
    later use (every thread, every helper SGLang hands it to) goes through the wrapper. None
    (teardown) and an already wrapped value are stored as they are."""

    def get(self):
        try:
            return self.__dict__[key]
        except KeyError:
            raise AttributeError(key) from None

    def set(self, value):
        if self._verify_on and value is not None and getattr(value, "_verify_wrapped", False) is not True:
            value = wrap(self, value)
        self.__dict__[key] = value

    return property(get, set, doc=doc)


class VerifiedTransferMixin:
    """Verified transfers over SGLang's common status codec; see the module docstring.
    Cooperative, outermost; an engine adapter subclasses it and feeds ``_verify_add_blocks``."""

    # First frames of the plugin's own messages to prefill's bootstrap socket that this class's
    # ``_handle_abort_notification`` takes where stock's loop offers it decode's messages
    # (``releases.stock_bootstrap_reads_notices``); F15's screen hands them on.
    plugin_bootstrap_tags = (NOTICE_TAG,)

    def __init__(self, *args, **kwargs):
        """Contract: as ``MooncakeKVManager.__init__`` (scheduler thread, startup, once per
        process). The stock constructor starts the transfer and status threads, which
        use the tables below, so they exist before ``super().__init__``.
        """
        self._verify_on = verify_enabled()
        # SGLANG_DISAGG_EXT_VERIFY=require, read once with the switch: a room without every
        # prefill rank's digest fails on decode instead of succeeding unverified.
        self._verify_required = verify_required()
        self._verify_tls = threading.local()
        self._verify_lock = threading.Lock()
        self._verify_session_room: Dict[str, int] = {}
        self._verify_partials: Dict[Tuple[int, str], _Partial] = {}
        self._verify_frames: Dict[int, Dict[int, bytes]] = {}
        self._verify_replies: Dict[int, Dict[int, Tuple[str, int]]] = {}
        self._verify_src: Optional[Tuple[List[_Buffer], List[int]]] = None
        self._verify_dst: Dict[str, Tuple[int, List[_Buffer], List[int]]] = {}
        super().__init__(*args, **kwargs)
        if self._verify_on:
            logger.info("verified transfers on (%s=1): %s side digests every engine write",
                        VERIFY_ENV, self.disaggregation_mode.name.lower())

    # -- where the pools live --------------------------------------------------
    def _verify_device(self) -> torch.device:
        device = str(getattr(self.server_args, "device", "cuda") or "cuda")
        if device.startswith("cpu"):
            return torch.device("cpu")
        if ":" in device:
            return torch.device(device)
        return torch.device(device, int(getattr(self.kv_args, "gpu_id", 0) or 0))

    def _verify_local(self) -> Tuple[List[_Buffer], List[int]]:
        if self._verify_src is None:
            table = _local_buffers(self.kv_args, self._verify_device())
            self._verify_src = (table, [b.start for b in table])
        return self._verify_src

    def _verify_peer(self, session: str) -> Optional[Tuple[List[_Buffer], List[int]]]:
        """Decode ``session``'s registered buffers, items sized as prefill's counterparts."""
        info = self.decode_kv_args_table.get(session)
        if info is None:
            return None
        cached = self._verify_dst.get(session)
        if cached is not None and cached[0] == id(info):
            return cached[1], cached[2]
        src, _ = self._verify_local()
        item = {(b.component, b.index): b.item_len for b in src}
        # A decode pool may have more buffers than prefill's (an MTP draft layer):
        # those take the component's item length when all of prefill's agree.
        lens: Dict[int, set] = {}
        for b in src:
            lens.setdefault(b.component, set()).add(b.item_len)
        common = {c: next(iter(v)) for c, v in lens.items() if len(v) == 1}
        table = []

        def add(component, ptrs, dst_lens=()):
            # Decode's own item lengths where its registration lists them (per KV buffer,
            # per state buffer: head-sliced across TP sizes they differ from prefill's).
            for b, p in enumerate(ptrs or []):
                n = item.get((component, b), common.get(component))
                if component == dg.KV_COMPONENT and getattr(info, "dst_kv_item_len", 0):
                    n = int(info.dst_kv_item_len)
                if b < len(dst_lens) and dst_lens[b]:
                    n = int(dst_lens[b])
                if p:
                    # Decode's buffer lengths are not registered: a destination
                    # address belongs to the nearest buffer start below it. An
                    # unsized buffer (n 0) still bounds its neighbour; a block
                    # landing in it leaves the room unverified.
                    table.append(_Buffer(p, 1 << 62, component, b, n or 0, None))

        kv_ptrs, aux_ptrs, state_ptrs = self._verify_dst_pointers(info)
        add(dg.KV_COMPONENT, kv_ptrs, list(getattr(info, "dst_kv_item_lens", None) or []))
        add(dg.AUX_COMPONENT, aux_ptrs)
        state_lens = self._verify_dst_state_lens(info)
        for i, ptrs in enumerate(state_ptrs):
            add(dg.STATE_COMPONENT_BASE + i, ptrs, state_lens[i] if i < len(state_lens) else ())
        # Decode's staging ring (SGLANG_DISAGG_STAGING_BUFFER, Mooncake and NIXL from 0.5.19;
        # CUDA/XPU pools only): a staged room is written there and decode scatters it into its
        # pool itself, after the engine, so no registered page is what prefill wrote. An
        # unsized entry: a block landing in it leaves the room unverified (never failed),
        # and it bounds the buffer below it (else a staged block would be read as a page
        # far past that buffer's end, and decode would fail the room on that page).
        staging = int(getattr(info, "staging_base_ptr", 0) or 0)
        if staging:
            table.append(_Buffer(staging, 1 << 62, STAGING_COMPONENT, 0, 0, None))
        table.sort(key=lambda b: b.start)
        for a, b in zip(table, table[1:]):
            a.end = b.start
        self._verify_dst[session] = (id(info), table, [b.start for b in table])
        return table, [b.start for b in table]

    def _verify_dst_state_lens(self, info) -> List[List[int]]:
        """Decode's state item lengths per component as its registration lists them (empty
        where it lists none: each buffer then takes prefill's length)."""
        return state_lists(getattr(info, "dst_state_item_lens", None))

    def _verify_dst_pointers(self, info) -> Tuple[List[int], List[int], List[List[int]]]:
        """Decode's registered buffer starts (KV, aux, state per component) in its
        registration ``info``; Mooncake and NIXL list them as pointers."""
        return (list(info.dst_kv_ptrs or []), list(info.dst_aux_ptrs or []),
                state_lists(getattr(info, "dst_state_data_ptrs", None)))

    # -- prefill: digest what goes to the engine ---------------------------------
    def transfer_worker(self, queue, *args, **kwargs):
        """Stock ``transfer_worker`` on a view of its queue that notes each chunk's room.

        Contract: prefill only; SGLang's constructor starts one thread per transfer
        queue with this as target (``queue`` then engine- and release-specific extras:
        Mooncake's executor, NIXL's staging buffer and worker index, passed through).
        Every item the queue yields has ``.room``. Must not change what the loop gets or does.
        """
        if not self._verify_on:
            return super().transfer_worker(queue, *args, **kwargs)
        return super().transfer_worker(RoomQueue(queue, self), *args, **kwargs)

    def add_transfer_request(self, bootstrap_room, *args, **kwargs):
        """Stock ``add_transfer_request`` with the room noted for the writes it makes.

        Contract: prefill scheduler thread, once per chunk (from the sender's ``send``).
        Where the release issues the chunk's writes here, on this thread (NIXL up to 0.5.11,
        MoRI up to 0.5.12.x: no transfer-worker queue), the room is this thread's for the
        call and restored after; where it only enqueues the chunk, the worker's queue view
        notes it (:meth:`transfer_worker`). Arguments, result and exceptions are stock's.
        """
        if not self._verify_on:
            return super().add_transfer_request(bootstrap_room, *args, **kwargs)
        tls = self._verify_tls
        outer, tls.room = getattr(tls, "room", None), bootstrap_room
        try:
            return super().add_transfer_request(bootstrap_room, *args, **kwargs)
        finally:
            tls.room = outer

    def _verify_room(self, session: str) -> Optional[int]:
        room = getattr(self._verify_tls, "room", None)
        return room if room is not None else self._verify_session_room.get(session)

    def _verify_partial(self, session: str) -> Optional[_Partial]:
        room = self._verify_room(session)
        if room is None:
            return None
        with self._verify_lock:
            return self._verify_partials.setdefault((room, session), _Partial())

    def _verify_mark_unplaced(self, session: str, why: str) -> None:
        partial = self._verify_partial(session)
        if partial is not None and partial.unplaced is None:
            partial.unplaced = why

    def _verify_write(self, session: str, blocks_of: Callable[[], object], what: str) -> None:
        """Add the blocks ``blocks_of()`` gives (``(src, dst, length)`` rows; None or empty:
        nothing) to the room's partial for decode ``session``. Called on the prefill's
        transfer threads just before the engine (or the TCP send) reads the source.
        Never raises: a digest that cannot be taken is logged and leaves the room
        unverified for that decode, and the transfer goes on as stock's."""
        try:
            blocks = blocks_of()
            if blocks is not None and len(blocks):
                self._verify_add_blocks(session, blocks)
        except Exception:  # noqa: BLE001 - verification must never fail a transfer by itself
            logger.exception("verified transfers: digest of %s failed; the room goes unverified", what)
            self._verify_mark_unplaced(session, "digest raised")

    def _verify_rows_over_tcp(self, session: str, dst_aux_ptrs_of: Callable[[], List[int]],
                              src_row: int, dst_row: int) -> None:
        """The metadata rows a ``send_aux_tcp`` is about to send, digested as the blocks an
        RDMA write would have been (row ``src_row`` of each prefill buffer to row ``dst_row``
        of decode's buffer of the same index). Prefill only; never raises."""
        if self._verify_on and self.disaggregation_mode.name == "PREFILL":
            self._verify_write(session, lambda: aux_row_blocks(
                self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens, dst_aux_ptrs_of(),
                int(src_row), int(dst_row)), "the metadata rows over TCP")

    def _verify_add_blocks(self, session: str, blocks) -> None:
        partial = self._verify_partial(session)
        if partial is None or partial.unplaced is not None:
            return
        src_table, _ = self._verify_local()
        peer = self._verify_peer(session)
        if peer is None:
            partial.unplaced = f"decode session {session} not registered"
            return
        dst_table, _ = peer
        if not src_table or not dst_table:
            partial.unplaced = "no registered buffers to place the blocks in"
            return
        # Vectorised over the blocks (SGLang passes every layer's blocks of a chunk
        # at once; a fragmented pool gives hundreds of one-run blocks): each block's
        # source and destination buffer by binary search over the buffer starts,
        # then whole-item blocks grouped per (source, destination) buffer so each
        # buffer's items are digested in one call.
        b = _block_array(blocks)
        src_addr, dst_addr, length = b[:, 0], b[:, 1], b[:, 2]
        s_start, s_end, s_item = _table_arrays(src_table)
        d_start, d_end, d_item = _table_arrays(dst_table)
        si = np.searchsorted(s_start, src_addr, side="right") - 1
        di = np.searchsorted(d_start, dst_addr, side="right") - 1
        ok = (si >= 0) & (di >= 0)
        si_c, di_c = np.where(ok, si, 0), np.where(ok, di, 0)
        n = d_item[di_c]
        ok &= (src_addr + length <= s_end[si_c]) & (dst_addr < d_end[di_c]) & (n > 0)
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            where = ("in decode's staging buffer (staged rooms are not verified)"
                     if di[k] >= 0 and dst_table[di[k]].component == STAGING_COMPONENT else "not in a registered buffer")
            partial.unplaced = f"block src 0x{int(src_addr[k]):x} dst 0x{int(dst_addr[k]):x} len {int(length[k])} {where}"
            return
        s_off, d_off = src_addr - s_start[si], dst_addr - d_start[di]
        whole = (s_item[si] == n) & (s_off % n == 0) & (d_off % n == 0) & (length % n == 0)
        # Head slices (parts of items): those inside one destination item in batches per
        # (source, destination, length), a heterogeneous-TP request has one per token per
        # layer; a span across an item boundary (rare) on its own.
        part = np.flatnonzero(~whole)
        inside = (d_off[part] % n[part]) + length[part] <= n[part]
        for k in part[~inside]:
            src, dst = src_table[si[k]], dst_table[di[k]]
            lo = int(s_off[k])
            value, pages = span_digest(src.flat()[lo:lo + int(length[k])], int(d_off[k]), dst.item_len,
                                       dst.component, dst.index)
            partial.add(dst.component, dst.index, value, pages)
        part = part[inside]
        if part.size:
            key = np.stack((si[part], di[part], length[part]))
            order = np.lexsort(key[::-1])
            part, key = part[order], key[:, order]
            cuts = np.flatnonzero(np.any(np.diff(key, axis=1) != 0, axis=0)) + 1
            for group in np.split(part, cuts):
                src, dst = src_table[si[group[0]]], dst_table[di[group[0]]]
                value, pages = span_digests(src.flat(), s_off[group], d_off[group], int(length[group[0]]),
                                            dst.item_len, dst.component, dst.index)
                partial.add(dst.component, dst.index, value, pages)
        if not whole.any():
            return
        w = np.flatnonzero(whole)
        key = si[w] * len(dst_table) + di[w]
        order = np.argsort(key, kind="stable")  # keeps each group's blocks in order
        w, key = w[order], key[order]
        # Every block's items at once (source rows, destination pages), each group a slice of
        # them: one pass for the request, not two per (source, destination) buffer pair.
        item_w = n[w]
        counts = length[w] // item_w
        rows_all = run_index(s_off[w] // item_w, counts)
        pages_all = run_index(d_off[w] // item_w, counts)
        item_end = np.cumsum(counts)
        first = np.concatenate(([0], np.flatnonzero(np.diff(key)) + 1))
        last = np.concatenate((first[1:], [w.size]))
        # Python lists for the loop: numpy scalars cost a conversion per use.
        src_of, dst_of = si[w].tolist(), di[w].tolist()
        ends = item_end.tolist()
        starts = (item_end - counts).tolist()
        requests, placed = [], []
        rows = pages = None
        for b0, b1 in zip(first.tolist(), last.tolist()):
            src, dst = src_table[src_of[b0]], dst_table[dst_of[b0]]  # whole items: src.item_len == dst.item_len
            i0, i1 = starts[b0], ends[b1 - 1]
            # A chunk's layers take the same rows to the same pages: the same objects for
            # each, so the kernels analyse them once and the pages are noted once.
            if pages is None or pages.size != i1 - i0 or not (pages == pages_all[i0:i1]).all():
                pages = pages_all[i0:i1]
            if b1 - b0 == 1:  # one contiguous run: digest it in place
                r0 = int(rows_all[i0])
                requests.append((src.rows()[r0:r0 + i1 - i0], dst.component, dst.index, pages, None))
            else:
                if rows is None or rows.size != i1 - i0 or not (rows == rows_all[i0:i1]).all():
                    rows = rows_all[i0:i1]
                requests.append((src.rows(), dst.component, dst.index, pages, rows))
            placed.append((dst.component, dst.index, pages))
        noted = set()
        for (component, buffer, pages), value in zip(placed, rows_digests(requests)):
            new = (component, id(pages)) not in noted
            noted.add((component, id(pages)))
            partial.add(component, buffer, value, pages if new else ())

    def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None):
        """Stock status push; a Success carries each target's digest as a trailing frame.

        Contract: prefill (transfer worker via ``conclude_transfer``, or ``sender.clear``)
        and decode (bootstrap readiness) call it with the room's decode endpoints.
        The room's ``transfer_infos`` still name the sessions behind each endpoint.
        Stock frames are unchanged; a stock decode parses frames 0-3 only.
        """
        if not self._verify_on or self.disaggregation_mode.name != "PREFILL" or status not in (_SUCCESS, _FAILED):
            return super().send_kv_status_message(
                targets=targets, bootstrap_room=bootstrap_room, status=status, failure_reason=failure_reason)
        with self._verify_lock:
            partials = {s: self._verify_partials.pop(k) for k in list(self._verify_partials)
                        if k[0] == bootstrap_room for s in [k[1]]}
        if int(status) != _SUCCESS or not targets:
            return super().send_kv_status_message(
                targets=targets, bootstrap_room=bootstrap_room, status=status, failure_reason=failure_reason)
        infos = dict(self.transfer_infos.get(bootstrap_room, {}) or {})
        for target in targets:
            frame = self._verify_frame(bootstrap_room, target, infos, partials)
            self._verify_tls.frame = frame
            try:
                super().send_kv_status_message(
                    targets=[target], bootstrap_room=bootstrap_room, status=status, failure_reason=failure_reason)
            finally:
                self._verify_tls.frame = None

    def _verify_frame(self, room, target, infos, partials) -> Optional[bytes]:
        sessions = [s for s, info in infos.items()
                    if not getattr(info, "is_dummy", False) and (info.endpoint, info.dst_port) == tuple(target)]
        merged = _Partial()
        for s in sessions:
            p = partials.get(s)
            if p is None:
                continue
            if p.unverifiable(room, f"{target[0]}:{target[1]}"):
                return None
            for (c, b), d in p.digests.items():
                merged.add(c, b, d, ())
            for c, ps in p.pages.items():
                merged.pages.setdefault(c, set()).update(ps)
        return dg.encode_frame(merged.digests, merged.pages)

    def _encode_kv_status_message(self, *, bootstrap_room, status, failure_reason):
        """Stock status frames, plus the digest frame ``send_kv_status_message`` set for this
        target (and prefill's reply address where it can hear a mismatch notice).

        Contract: called by ``send_kv_status_message`` (any thread) to build one
        message; must keep stock's frames and their order.
        """
        parts = list(super()._encode_kv_status_message(
            bootstrap_room=bootstrap_room, status=status, failure_reason=failure_reason))
        frame = getattr(self._verify_tls, "frame", None)
        if frame is not None:
            if not self.kv_status_msg_carries_reason:
                parts.append(b"")  # empty reason: stock reads it as None
            parts.extend(self._verify_trailing_frames(frame))
        return parts

    def _verify_trailing_frames(self, frame: Optional[bytes]) -> List[bytes]:
        """What a Success status carries after stock's frames: the digest ``frame`` and, where
        this prefill hears decode's notices, its reply address; nothing without a digest."""
        if frame is None:
            return []
        reply = self._verify_reply_frame()
        return [frame] if reply is None else [frame, reply]

    def _verify_listen_for_notices(self) -> None:
        """Prefill: take decode's mismatch notices off the bootstrap socket where stock's loop
        does not offer its messages to ``_handle_abort_notification``. Each adapter calls it
        from its override of the method that starts stock's bootstrap thread (once, scheduler
        thread, after ``server_socket`` is bound and before any decode knows this prefill);
        that loop reads ``self.server_socket`` for every message."""
        if (self._verify_on and self.disaggregation_mode.name == "PREFILL"
                and not releases.stock_bootstrap_reads_notices(type(self))):
            self.server_socket = FilteringSocket(self.server_socket, self._verify_take_notice, logger)
            self.__dict__["_verify_listening"] = True

    def _verify_take_notice(self, msg):
        """The bootstrap socket filter: a mismatch notice is taken here, every other message
        goes on to stock's loop unchanged."""
        return FilteringSocket.CONSUMED if self._verify_notice(msg) else None

    def _verify_reply_frame(self) -> Optional[bytes]:
        """Prefill's reply-address frame, built once per manager (it is sent with every
        verified Success; the class and the bound address do not change)."""
        cached = self.__dict__.get("_verify_reply")
        if cached is not None:
            return cached or None
        frame = b""
        if self.__dict__.get("_verify_listening") or releases.stock_bootstrap_reads_notices(type(self)):
            host, port = getattr(self, "local_ip", None), getattr(self, "rank_port", None)
            if host and port:
                frame = REPLY_MAGIC + f"{host}|{int(port)}".encode("utf-8")
        self.__dict__["_verify_reply"] = frame
        return frame or None

    # -- decode: compare before Success ----------------------------------------
    def parse_kv_status_message(self, msg):
        """Stock parse; a Success's trailing digest frame (and reply address) is kept for the room.

        Contract: decode's status thread calls it for every message that is not
        aux/staging/abort; its result goes to ``apply_prefill_status`` unchanged.
        Must not raise for any message (the thread would end).
        """
        parsed = super().parse_kv_status_message(msg)
        if parsed is None or not self._verify_on:
            return parsed
        room, status, prefill_rank, _ = parsed
        if status == _SUCCESS:
            for frame in msg[4:]:
                frame = bytes(frame)
                if frame.startswith(dg.FRAME_MAGIC):
                    self._verify_keep_frame(room, prefill_rank, frame)
                else:
                    self._verify_keep_reply(room, prefill_rank, frame)
        return parsed

    def _verify_keep_reply(self, room: int, prefill_rank: int, frame: bytes) -> None:
        """Decode: ``prefill_rank``'s reply address for ``room`` (a ``REPLY_MAGIC`` frame, see
        :meth:`_verify_reply_frame`), where :meth:`_verify_tell_prefill` sends a mismatch notice;
        anything else is ignored."""
        if not frame.startswith(REPLY_MAGIC):
            return
        host, _, port = frame[len(REPLY_MAGIC):].decode("utf-8", "replace").rpartition("|")
        if host and port.isdigit():
            with self._verify_lock:
                self._verify_replies.setdefault(room, {})[prefill_rank] = (host, int(port))

    def _verify_keep_frame(self, room: int, prefill_rank: int, frame: bytes) -> None:
        """Decode's status thread: ``prefill_rank``'s digest frame for ``room``, until
        :meth:`update_status` checks the room (or drops it on Failed)."""
        if frame.startswith(dg.FRAME_MAGIC):
            with self._verify_lock:
                self._verify_frames.setdefault(room, {})[prefill_rank] = frame

    def update_status(self, bootstrap_room, status):
        """Stock ``update_status``; on decode a Success is verified first.

        Contract: both sides, any SGLang thread (decode: the status thread once every
        prefill rank reported Success). A digest mismatch records the reason, moves
        the room to Failed instead and tells the prefill ranks that gave a reply
        address. Must not raise.
        """
        if not self._verify_on or self.disaggregation_mode.name != "DECODE":
            return super().update_status(bootstrap_room, status)
        if int(status) == _SUCCESS:
            with self._verify_lock:
                frames = self._verify_frames.pop(bootstrap_room, None)
                replies = self._verify_replies.pop(bootstrap_room, None)
            reason = self._verify_check(bootstrap_room, frames)
            if reason is not None:
                logger.error("room %s: %s", bootstrap_room, reason)
                self.record_failure(bootstrap_room, reason)
                self._verify_tell_prefill(bootstrap_room, reason, replies or {})
                return super().update_status(bootstrap_room, type(status)(_FAILED))
        elif int(status) == _FAILED:
            with self._verify_lock:
                self._verify_frames.pop(bootstrap_room, None)
                self._verify_replies.pop(bootstrap_room, None)
        return super().update_status(bootstrap_room, status)

    def _verify_tell_prefill(self, room: int, reason: str, replies: Dict[int, Tuple[str, int]]) -> None:
        """One notice to each prefill rank's bootstrap socket (SGLang's cached PUSH socket
        per endpoint); a send that fails is logged, the room stays Failed either way."""
        decode_rank = str(getattr(self.kv_args, "engine_rank", "?")).encode("ascii", "replace")
        parts = [NOTICE_TAG, str(room).encode("ascii"), decode_rank, reason.encode("utf-8")]
        for host, port in sorted(set(replies.values())):
            ipv6 = ":" in host
            endpoint = f"tcp://[{host}]:{port}" if ipv6 else f"tcp://{host}:{port}"
            try:
                self._verify_notice_socket(endpoint, ipv6).send_multipart(parts, flags=zmq.NOBLOCK)
            except Exception:  # noqa: BLE001 - the room is Failed on decode whatever prefill hears
                logger.exception("room %s: could not tell prefill %s of the mismatch", room, endpoint)
            else:
                metrics.count("verify_mismatch_notices_sent_total", prefill=f"{host}:{port}")

    def _verify_notice_socket(self, endpoint: str, ipv6: bool):
        """This thread's PUSH socket to a prefill's bootstrap address. Its own, not SGLang's
        cached ones: those are shared with the scheduler thread's sends to the same address
        (a ZMQ socket is not thread-safe), and releases before 0.5.19 have no locked send."""
        sockets = self._verify_tls.__dict__.setdefault("sockets", {})
        sock = sockets.get(endpoint)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            if ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            sockets[endpoint] = sock
        return sock

    # -- prefill: decode's mismatch notice ----------------------------------------
    def _handle_abort_notification(self, msg) -> bool:
        """Stock's check for decode's ``ABORT`` message; a mismatch notice is taken here.

        Contract: prefill's bootstrap thread offers it every message it receives before
        reading it as a registration or transfer info (see
        ``releases.stock_bootstrap_reads_notices``); True means consumed. The room
        concluded Success on prefill before decode checked it, so the notice is logged
        and counted (``verify_mismatch_reports_total``); nothing of the room is left to
        fail here. Must not raise.
        """
        return self._verify_notice(msg) or super()._handle_abort_notification(msg)

    def _verify_notice(self, msg) -> bool:
        """True for a mismatch notice (logged and counted here), False for any other message."""
        if not msg or bytes(msg[0]) != NOTICE_TAG:
            return False
        try:
            room = bytes(msg[1]).decode("ascii")
            rank = bytes(msg[2]).decode("ascii", "replace")
            reason = bytes(msg[3]).decode("utf-8", "replace")
        except (IndexError, UnicodeDecodeError):
            logger.error("verified transfers: malformed mismatch notice of %d frames", len(msg))
            return True
        metrics.count("verify_mismatch_reports_total")
        logger.error("room %s, concluded Success here: decode rank %s failed it on verification: %s",
                     room, rank, reason)
        return True

    def _verify_check(self, room, frames) -> Optional[str]:
        """None when the landed pages match the sources' digests (or cannot be checked), else the reason."""
        expected_ranks = self.required_prefill_response_num_table.get(room)
        if not frames or (expected_ranks is not None and len(frames) < expected_ranks):
            if self._verify_required:
                metrics.count("verified_transfers_total", result="refused_unverified")
                return (f"verified transfer required ({VERIFY_ENV}=require): room {room} arrived with "
                        f"digests from {len(frames or ())} of {expected_ranks if expected_ranks is not None else 'its'} "
                        "prefill rank(s) (a prefill that does not verify, or a rank that sent none)")
            metrics.count("verified_transfers_total", result="unverified")
            return None
        try:
            decoded = {rank: dg.decode_frame(f) for rank, f in frames.items()}
            expected, pages, ranks = dg.merge_frames(decoded)
            actual = self._verify_landed(expected, pages)
        except Exception as exc:  # noqa: BLE001 - a broken frame or index fails the room, never the thread
            metrics.count("verify_mismatches_total", component="frame")
            return f"verified transfer: cannot check room {room}: {type(exc).__name__}: {exc}"
        bad = dg.first_mismatch(expected, actual)
        if bad is None:
            metrics.count("verified_transfers_total", result="ok")
            return None
        c, b = bad
        name = dg.component_name(c)
        metrics.count("verify_mismatches_total", component=name)
        return (
            f"verified transfer: digest mismatch in component {name} buffer {b} from prefill rank(s) "
            f"{ranks.get(bad)} over {len(pages.get(c, []))} decode page(s): prefill 0x{expected[bad]:016x}, "
            f"decode 0x{actual.get(bad, 0):016x}"
        )

    def _verify_landed(self, expected, pages) -> Dict[Tuple[int, int], int]:
        table, _ = self._verify_local()
        by_key = {(b.component, b.index): b for b in table}
        # One index array per component, shared by its buffers (the kernels convert a list per use).
        page_arrays = {c: np.asarray(ps, dtype=np.int64) for c, ps in pages.items()}
        no_pages = np.empty(0, dtype=np.int64)
        keys, requests = [], []
        for (c, b) in expected:
            buf = by_key.get((c, b))
            if buf is None:
                raise dg.DigestError(f"component {dg.component_name(c)} buffer {b}: decode has no such buffer")
            ps = page_arrays.get(c, no_pages)
            n_items = (buf.end - buf.start) // buf.item_len
            if ps.size and (ps[0] < 0 or ps[-1] >= n_items):  # sorted (merge_frames)
                raise dg.DigestError(f"component {dg.component_name(c)} buffer {b}: page {ps[-1]} "
                                     f"outside decode's {n_items} pages")
            keys.append((c, b))
            requests.append((buf.rows(), c, b, ps, ps))
        return dict(zip(keys, rows_digests(requests)))
