"""Verified transfers for ``mori-ext``: where MoRI's writes meet the digest.

SGLang's MoRI manager moves every byte RDMA carries with ``engine.batch_write(local
descriptors, local offsets, remote descriptors, remote offsets, sizes, uids)``: each
entry writes ``sizes[i][j]`` bytes from ``local[i].data + local_offsets[i][j]`` to
``remote[i].data + remote_offsets[i][j]`` of engine ``remote[i].engine_key`` (a MoRI
``MemoryDesc`` carries its region's address and its engine's key). So the manager's
``engine`` is wrapped (:class:`RecordingEngine`, through a property set when SGLang's
constructor assigns it) and each batch's blocks go to
:meth:`.VerifiedTransferMixin._verify_add_blocks` per decode engine, before the batch
is handed to MoRI. Decode's buffer starts come from the descriptors in its registration.
Everything else (placement, partials, the status frame, decode's check) is
:mod:`..common.verify`'s.

Where MoRI concludes rooms through SGLang's common status codec (0.5.20+, probe
``mori_status_codec``) the digest rides there as for the other engines. Up to 0.5.19
(probe ``mori_sender_notifies_status``) MoRI builds its own status message
(``notify_decode_status``: guard, room, status, rank, reason) and its decode worker reads
it by position, never past the reason: the digest goes as one more trailing frame to
every decode (stock ignores it), and the ``-ext`` decode reads it through a socket
filter before the worker does. The metadata rows over TCP (``send_aux_tcp``, the default
without RDMA for aux) are no engine write: they are digested as the blocks an RDMA write
would have (``core.aux_rows.aux_row_blocks``), so decode checks the aux page as on the RDMA
path (an ``-ext`` decode applies a room's Success after its rows: F12's order).
MoRI's prefill bootstrap loop never offers decode's messages to
``_handle_abort_notification``: the ``-ext`` prefill reads its bootstrap socket through a
filter that takes decode's mismatch notice, and its Success carries the reply address
(the codec's trailing frame, or one more frame of MoRI's own message). Tested against the MoRI stand-in (``test/support/mori_standin``):
MoRI's engine cannot run on a machine without its RDMA stack.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from sglang_disagg_ext import releases
from sglang_disagg_ext.backends.common.shared import FilteringSocket
from sglang_disagg_ext.backends.common.verify import (
    _SUCCESS,
    RoomQueue,
    VerifiedTransferMixin,
    logger,
    recorded_attribute,
    state_lists,
)
from sglang_disagg_ext.core import digest as dg


def _room_of(item) -> Optional[int]:
    """The room of a transfer-queue item: ``.room`` (0.5.20+ chunks), or its sender's
    ``bootstrap_room`` (0.5.13-0.5.19 ``_TransferChunk``); None for teardown's sentinel."""
    room = getattr(item, "room", None)
    if room is None:
        room = getattr(getattr(item, "sender", None), "bootstrap_room", None)
    return room


class RecordingEngine:
    """A MoRI ``IOEngine`` whose ``batch_write`` batches are reported to
    ``on_write(engine_key, blocks)`` (``N x 3`` int64 ``(src, dst, length)``) before MoRI gets
    them. Every other attribute is the engine's own; results are the engine's."""

    _verify_wrapped = True

    def __init__(self, engine, on_write):
        self._engine = engine
        self._on_write = on_write

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def batch_write(self, local_descs, local_offsets, remote_descs, remote_offsets, sizes, *args, **kwargs):
        by_peer: Dict[str, List[np.ndarray]] = {}
        for src, s_off, dst, d_off, n in zip(local_descs, local_offsets, remote_descs, remote_offsets, sizes):
            s_off, d_off, n = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (s_off, d_off, n))
            by_peer.setdefault(str(dst.engine_key), []).append(
                np.column_stack((int(src.data) + s_off, int(dst.data) + d_off, n)))
        for peer, parts in by_peer.items():
            self._on_write(peer, np.concatenate(parts))
        return self._engine.batch_write(local_descs, local_offsets, remote_descs, remote_offsets, sizes,
                                        *args, **kwargs)


class MoriVerifiedTransferMixin(VerifiedTransferMixin):
    """MoRI's entry: the blocks of each ``batch_write`` (see the module)."""

    engine = recorded_attribute(
        "_verify_mori_engine", lambda self, engine: RecordingEngine(engine, self._verify_mori_write),
        """The manager's MoRI ``IOEngine``; with verification on, wrapped in :class:`RecordingEngine`.

        Contract: SGLang's constructor assigns ``self.engine`` (both sides; teardown sets it
        to None) and its threads use it afterwards; the wrapper changes no argument or result.""")

    def _transfer_worker(self, queue, *args, **kwargs):
        """Stock ``_transfer_worker`` on a view of its queue that notes each chunk's room.

        Contract: prefill only; SGLang's constructor starts one thread per transfer queue
        with this as target; every item has ``.room`` (teardown's None sentinel passes
        through). Must not change what the loop gets or does.
        """
        if not self._verify_on:
            return super()._transfer_worker(queue, *args, **kwargs)
        return super()._transfer_worker(RoomQueue(queue, self, _room_of), *args, **kwargs)

    def _start_bootstrap_thread(self, *args, **kwargs):
        """Stock's bootstrap thread, reading through a filter that takes decode's mismatch
        notices (MoRI's loop never offers them to ``_handle_abort_notification``; see
        :meth:`.VerifiedTransferMixin._verify_listen_for_notices`).

        Contract: prefill only, called once from stock's constructor after ``server_socket``
        is bound; the loop it starts reads ``self.server_socket`` for every message and
        drops one without MoRI's guard. Every other message reaches it unchanged.
        """
        self._verify_listen_for_notices()
        return super()._start_bootstrap_thread(*args, **kwargs)

    def _verify_dst_pointers(self, info) -> Tuple[List[int], List[int], List[List[int]]]:
        """MoRI registers decode's buffers as memory descriptors: their addresses."""
        def addrs(descs):
            # F3's per-component registration lists None for a zero-length state tensor
            # (0.5.12.x, backends.mori.conn): 0 keeps the buffer's index and places nothing there.
            return [int(d.data) if d is not None else 0 for d in descs or []]

        states = state_lists(getattr(info, "dst_state_mem_descs", None))
        return addrs(info.dst_kv_mem_descs), addrs(info.dst_aux_mem_descs), [addrs(s) for s in states]

    def _verify_mori_write(self, peer: str, blocks: Optional[np.ndarray]) -> None:
        """One batch about to go to MoRI (transfer worker thread, prefill). Must never
        raise: a digest that cannot be taken leaves the room unverified."""
        if self.disaggregation_mode.name == "PREFILL":
            self._verify_write(peer, lambda: blocks, "a MoRI transfer")

    def send_aux_tcp(self, peer_info, prefill_aux_index, dst_aux_index, room, *args, **kwargs):
        """Stock's metadata rows over TCP, digested first as the blocks an RDMA write would have.

        Contract: prefill, the room's last chunk (transfer worker from 0.5.13), where SGLang
        sends each metadata row as an ``AUX_DATA`` message to ``peer_info``'s decode; result
        and exceptions are stock's; the digest never raises into it.
        """
        self._verify_rows_over_tcp(str(peer_info.engine_key),
                                   lambda: [int(d.data) for d in peer_info.dst_aux_mem_descs or []],
                                   prefill_aux_index, dst_aux_index)
        return super().send_aux_tcp(peer_info, prefill_aux_index, dst_aux_index, room, *args, **kwargs)

    # -- up to 0.5.19: MoRI's own status message ----------------------------------------
    def notify_decode_status(self, infos, bootstrap_room, status, failure_reason=None):
        """Stock's status message; a Success carries each decode endpoint's digest as one
        more trailing frame.

        Contract: prefill only, up to 0.5.19 (0.5.20+ conclude through the common codec):
        the sender (its ``poll`` up to 0.5.12.x, a transfer worker from 0.5.13) calls it once
        when a room concludes, with the room's ``TransferInfo``s
        (one per decode engine; the room's partials are keyed by their ``engine_key``).
        Stock's frames (guard, room, status, rank, reason or empty) go out unchanged and
        in order; stock's decode worker reads them by position and never the one after.
        The room's partials are taken whatever the status. A send that fails is logged,
        as stock does. Must not raise more than stock does.
        """
        if (not self._verify_on or releases.features().mori_status_codec
                or self.disaggregation_mode.name != "PREFILL" or not infos):
            return super().notify_decode_status(infos, bootstrap_room, status, failure_reason)
        with self._verify_lock:
            partials = {k[1]: self._verify_partials.pop(k) for k in list(self._verify_partials)
                        if k[0] == bootstrap_room}
        if int(status) != _SUCCESS:
            return super().notify_decode_status(infos, bootstrap_room, status, failure_reason)
        from sglang.srt.disaggregation.mori.conn import MORI_GUARD
        from sglang.srt.utils.network import NetworkAddress

        by_target: Dict[Tuple[str, int], dict] = {}
        for info in infos:
            by_target.setdefault((info.endpoint, int(info.dst_port)), {})[str(info.engine_key)] = info
        if releases.features().mori_unique_prefill_rank:
            rank, connect = self._compute_prefill_unique_rank(), self._connect_threadsafe
        else:  # 0.5.10.post1-0.5.11 (mori/conn.py:411, :417)
            rank, connect = self.attn_tp_rank * self.pp_size + self.pp_rank, self._connect
        stock = [MORI_GUARD, str(bootstrap_room).encode("ascii"), str(int(status)).encode("ascii"),
                 str(rank).encode("ascii"), failure_reason.encode("utf-8") if failure_reason else b""]
        for target, group in by_target.items():
            extra = self._verify_trailing_frames(self._verify_frame(bootstrap_room, target, group, partials))
            try:
                na = NetworkAddress(*target)
                connect(na.to_tcp(), is_ipv6=na.is_ipv6).send_multipart(stock + extra)
            except Exception:  # noqa: BLE001 - as stock: the room's status stays what it is
                logger.exception("Failed to sync status %s to decode endpoint %s:%s for room %s",
                                 status, target[0], target[1], bootstrap_room)

    def _start_decode_thread(self):
        """Stock's decode worker, reading through a socket that keeps each Success's digest frame.

        Contract: decode only; SGLang's constructor calls it once, after ``server_socket``
        is bound and before any prefill knows this decode. Up to 0.5.19 the worker reads
        ``self.server_socket`` for every message; the filter hands each one on unchanged
        (stock never reads the trailing frame) and must never raise into that thread.
        """
        if self._verify_on and not releases.features().mori_status_codec:
            from sglang.srt.disaggregation.mori.conn import MORI_GUARD

            self._verify_guard = bytes(MORI_GUARD)
            self.server_socket = FilteringSocket(self.server_socket, self._verify_note_status, logger)
        return super()._start_decode_thread()

    def _verify_note_status(self, msg):
        """A status message ``[guard, room, status, rank, reason, digest(, reply)]``: keep a
        Success's digest (and prefill's reply address) for the room; None (every message goes
        on unchanged)."""
        if len(msg) >= 6 and bytes(msg[0]) == self._verify_guard and int(bytes(msg[2]).decode("ascii")) == _SUCCESS:
            frame = bytes(msg[5])
            if frame.startswith(dg.FRAME_MAGIC):
                room, rank = int(bytes(msg[1]).decode("ascii")), int(bytes(msg[3]).decode("ascii"))
                self._verify_keep_frame(room, rank, frame)
                if len(msg) >= 7:
                    self._verify_keep_reply(room, rank, bytes(msg[6]))
        return None
