"""Verified transfers for ``mooncake-ext``: where Mooncake's writes meet the digest.

Most engine writes of SGLang's Mooncake manager (KV, paged state, Mamba slots, the
aux row) go through ``_transfer_data(session, blocks)`` with ``(src, dst, length)``
blocks for one decode session: the digest is taken there, before the engine reads
the source. Some call the engine themselves: 0.5.23's heterogeneous-TP
``send_kvcache_slice`` hands every head slice straight to
``engine.batch_transfer_sync``. So the manager's ``engine`` is also wrapped
(:class:`RecordingMooncakeEngine`, through the property SGLang's constructor assigns):
a ``batch_transfer_sync`` / ``transfer_sync`` that does not come from
``_transfer_data`` on this thread reports its blocks the same way, before the
engine runs. The rest (placement, partials, the status frame, decode's check) is
:mod:`..common.verify`'s.

Up to 0.5.19 (no common status codec) the decode's status loop unpacks exactly three
frames. There the digest rides as the fourth frame that :mod:`.peers` already
uses for failure reasons (``DIGEST_PREFIX``), sent only to a decode whose registration
said it reads digests (an ``-ext`` decode with verification on: it takes the frame off
before stock reads the message); any other decode gets stock's three frames and the
room goes unverified there; prefill's reply address follows the digest as a fifth frame.
Before 0.5.22 stock's bootstrap loop takes no notices: ``start_prefill_thread`` starts it
on a socket filter that takes decode's mismatch notice first.

The aux row over TCP (``send_aux_tcp``: ``SGLANG_MOONCAKE_SEND_AUX_TCP``, or an NVLink
pool) is no engine write: its rows are digested as the blocks an RDMA write would have
(``core.aux_rows.aux_row_blocks``), so decode checks the aux page as on the RDMA path. They
go on the same cached socket as prefill's Success status, before it, and decode's status
thread writes them before it reads that status.

Not covered: staging (the destination is decode's staging ring, not a registered pool: a
block landing there leaves the room unverified; see ``VerifiedTransferMixin._verify_peer``).
"""

from __future__ import annotations

import threading

import numpy as np

from sglang_disagg_ext import releases
from sglang_disagg_ext.backends.mooncake.peers import DIGEST_PREFIX
from sglang_disagg_ext.backends.common.verify import _SUCCESS, VerifiedTransferMixin, recorded_attribute


class RecordingMooncakeEngine:
    """SGLang's Mooncake transfer engine, whose writes that ``_transfer_data`` did not digest are
    reported to ``on_write(session, blocks)`` (``N x 3`` int64) before they run. Every other
    attribute is the engine's own; results are the engine's."""

    _verify_wrapped = True

    def __init__(self, engine, on_write, inside: threading.local):
        self._engine = engine
        self._on_write = on_write
        self._inside = inside  # .depth > 0: this thread is inside _transfer_data (already digested)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def batch_transfer_sync(self, session_id, buffers, peer_buffer_addresses, lengths, *args, **kwargs):
        if not getattr(self._inside, "depth", 0):
            self._on_write(session_id, np.column_stack((
                np.asarray(buffers, dtype=np.int64).reshape(-1),
                np.asarray(peer_buffer_addresses, dtype=np.int64).reshape(-1),
                np.asarray(lengths, dtype=np.int64).reshape(-1))))
        return self._engine.batch_transfer_sync(session_id, buffers, peer_buffer_addresses, lengths, *args, **kwargs)

    def transfer_sync(self, session_id, buffer, peer_buffer_address, length, *args, **kwargs):
        if not getattr(self._inside, "depth", 0):
            self._on_write(session_id, np.array([[buffer, peer_buffer_address, length]], dtype=np.int64))
        return self._engine.transfer_sync(session_id, buffer, peer_buffer_address, length, *args, **kwargs)


class MooncakeVerifiedTransferMixin(VerifiedTransferMixin):
    """Mooncake's entry: the blocks of each ``_transfer_data`` call, and of any engine write
    that bypasses it."""

    engine = recorded_attribute(
        "_verify_mooncake_engine",
        lambda self, engine: RecordingMooncakeEngine(engine, self._verify_engine_write, self._verify_inside),
        """The manager's Mooncake transfer engine; with verification on, wrapped in
        :class:`RecordingMooncakeEngine`.

        Contract: SGLang's constructor assigns ``self.engine`` once (both sides) and every
        thread uses it afterwards; the wrapper changes no argument or result.""")

    @property
    def _verify_inside(self) -> threading.local:
        inside = self.__dict__.get("_verify_inside_tls")
        if inside is None:
            inside = self.__dict__["_verify_inside_tls"] = threading.local()
        return inside

    def _transfer_data(self, mooncake_session_id, transfer_blocks):
        """Stock ``_transfer_data``, after adding the blocks' digest to the room's partial.

        Contract: prefill only; every KV, state and aux write of the transfer worker
        (and of its executor's threads) goes through it with ``(src, dst, length)``
        blocks for one decode session; its rc is the engine's. The digest is taken
        before the engine reads the source (not beside it: a digest read while the
        engine reads would no longer pin the bytes prefill meant to send). Must never
        raise on the digest's account.
        """
        if not (self._verify_on and transfer_blocks):
            return super()._transfer_data(mooncake_session_id, transfer_blocks)
        self._verify_write(mooncake_session_id, lambda: transfer_blocks, "a transfer")
        inside = self._verify_inside
        inside.depth = getattr(inside, "depth", 0) + 1  # its engine call is digested already
        try:
            return super()._transfer_data(mooncake_session_id, transfer_blocks)
        finally:
            inside.depth -= 1

    def send_aux_tcp(self, req, prefill_aux_index, dst_aux_ptrs, *args, **kwargs):
        """Stock's aux rows over TCP, digested first as the blocks an RDMA write would have.

        Contract: prefill transfer worker, from ``send_aux`` in a room's last chunk, where
        SGLang sends the metadata rows as ``AUX_DATA`` messages (``SGLANG_MOONCAKE_SEND_AUX_TCP``
        or an NVLink pool); ``req`` is the decode session's ``TransferInfo``. Result and
        exceptions are stock's; the digest never raises into it.
        """
        self._verify_rows_over_tcp(str(req.mooncake_session_id), lambda: dst_aux_ptrs,
                                   prefill_aux_index, req.dst_aux_index)
        return super().send_aux_tcp(req, prefill_aux_index, dst_aux_ptrs, *args, **kwargs)

    def _verify_engine_write(self, session, blocks) -> None:
        """An engine write outside ``_transfer_data`` (prefill transfer threads). Must never raise."""
        if self.disaggregation_mode.name == "PREFILL":
            self._verify_write(str(session), lambda: blocks, "a Mooncake engine write")

    # -- releases without the common status codec (up to 0.5.19) ----------------
    def sync_status_to_decode_endpoint(self, remote, dst_port, room, status, prefill_rank):
        """Stock's status message; a Success to a decode that reads digests also carries this
        endpoint's digest as a fourth frame.

        Contract: prefill only, up to 0.5.19 (0.5.20+ send statuses through
        ``send_kv_status_message``); the transfer worker calls it once per decode endpoint of
        a concluded room, while ``transfer_infos[room]`` still names the sessions behind each
        endpoint (and the scheduler thread for refusals). The room's partials for this
        endpoint's sessions are taken whatever the status. Stock's three frames are unchanged;
        a decode that did not say it reads digests gets exactly those. Must not raise more
        than stock does.
        """
        if (not self._verify_on or releases.features().kv_status_codec
                or self.disaggregation_mode.name != "PREFILL"):
            return super().sync_status_to_decode_endpoint(remote, dst_port, room, status, prefill_rank)
        target = (remote, int(dst_port))
        infos = dict(self.transfer_infos.get(room, {}) or {})
        sessions = {s for s, info in infos.items() if (info.endpoint, int(info.dst_port)) == target}
        with self._verify_lock:
            partials = {k[1]: self._verify_partials.pop(k) for k in list(self._verify_partials)
                        if k[0] == room and k[1] in sessions}
        frame = None
        if int(status) == _SUCCESS and target in getattr(self, "_digest_endpoints", ()):
            frame = self._verify_frame(room, target, infos, partials)
        if frame is None:
            return super().sync_status_to_decode_endpoint(remote, dst_port, room, status, prefill_rank)
        self._send_status_with(remote, dst_port, room, status, prefill_rank,
                               *self._verify_trailing_frames(DIGEST_PREFIX + frame))

    def _keep_digest_frame(self, room: int, prefill_rank: int, frame: bytes, reply) -> None:
        """Contract: decode's status thread (through :mod:`.peers`' socket filter, up
        to 0.5.19) hands each Success's digest frame (and prefill's reply address, or None)
        here before stock reads the message; :meth:`update_status` checks it when stock
        concludes the room. Must not raise."""
        if self._verify_on:
            self._verify_keep_frame(room, prefill_rank, frame)
            if reply is not None:
                self._verify_keep_reply(room, prefill_rank, reply)

    def start_prefill_thread(self, *args, **kwargs):
        """Stock's prefill bootstrap thread, reading through a filter that takes decode's
        mismatch notices where stock's loop does not (before 0.5.22; see
        :meth:`.VerifiedTransferMixin._verify_listen_for_notices`).

        Contract: prefill only; SGLang's constructor calls it once, after ``server_socket`` is
        bound and before any decode can register. Up to 0.5.21 the loop reads
        ``self.server_socket`` for every message (directly or through ``_make_worker_recv``);
        every other message reaches it unchanged.
        """
        self._verify_listen_for_notices()
        return super().start_prefill_thread(*args, **kwargs)
