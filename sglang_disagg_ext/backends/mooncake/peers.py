"""What ``mooncake-ext`` prefill knows of each decode's pools, and which decode sessions it refused (F6, F9, F18).

A decode's stock registration message carries its buffer pointers and counts
but not how many pages or rows each pool holds, nor its metadata row sizes.
An ``-ext`` decode appends them as one extra, trailing frame
(:mod:`..core.index_bounds`); stock ``KVArgsRegisterInfo.from_zmq`` reads fixed
positions and ignores it, so a stock prefill is unaffected. An ``-ext``
prefill notes the frame per decode session as the registration arrives
(``_peer_bounds``), before stock parses the message; a decode that published
none (stock) is named once at INFO and left unchecked.

The fixes that judge a session by its registration (F9 its metadata buffers,
F18 its KV layout) record their verdicts here too (``_refuse_session`` /
``_accept_session``), and one ``add_transfer_request`` / ``send_aux`` ends every
request to a refused session Failed with that fix's reason.

Two ways in, by release (``releases.features().mooncake_registration_hooks``):

* 0.5.23: stock's hooks, ``build_receiver_registration_message`` (decode) and
  ``_make_worker_recv`` (prefill's receive function);
* 0.5.10.post1-0.5.22, where the receiver builds the registration itself and
  prefill's bootstrap thread reads ``server_socket`` (directly up to 0.5.20,
  through ``_make_worker_recv`` from 0.5.21): the receiver
  (:class:`MooncakeExtKVReceiver`) sends stock's message through a socket that
  appends the frame, and prefill reads through a :class:`..shared.FilteringSocket`.

Failure reasons to decode: from 0.5.20 the status message goes through SGLang's
common codec, which carries a reason frame to any decode. Older decode loops unpack
exactly three frames (room, status, rank; 0.5.11 mooncake/conn.py:1474) and
die on a fourth, so there prefill adds the reason only for a decode that
published pool sizes (this plugin's decode, which takes the frame off before
stock reads the message and records the reason in place of stock's "it might
be dead"); a stock decode gets stock's three frames. The same fourth frame
carries a verified prefill's digest with a Success (
:mod:`.verify`), only to a decode whose frame says it reads digests.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_disagg_ext import metrics, releases
from sglang_disagg_ext.backends.common.shared import FilteringSocket, note_peer_bounds, pool_bounds_frame, register_appending
from sglang_disagg_ext.core.thread_survival import prefill_unique_rank

logger = logging.getLogger("sglang_disagg_ext.mooncake.peers")

# First frame of a decode registration message (stock: the room field reads "None").
REGISTRATION = b"None"
# Fourth frame of a Failed status message to an -ext decode (releases whose decode
# unpacks exactly three frames): this prefix, then prefill's reason (UTF-8).
REASON_PREFIX = b"sglang-disagg-ext:reason:"
# Fourth frame of a Success status message to an -ext decode that reads digests
# (same releases): this prefix, then core.digest's frame.
DIGEST_PREFIX = b"sglang-disagg-ext:digest:"


def state_kinds_of(kv_args) -> list:
    """Each state component's kind ("swa", "nsa", ...), in :func:`..shared.pool_bounds_frame`'s order."""
    kinds = getattr(kv_args, "state_types", None)
    if kinds is None:  # flat layout: one component
        kind = getattr(kv_args, "state_type", "none")
        kinds = [] if kind in (None, "none") else [kind]
    return [getattr(t, "value", t) for t in kinds]


def refused_session(mgr, room):
    """Prefill: ``(session, fix, metric reason, reason)`` of the first non-dummy decode rank of ``room``
    whose session was refused at registration (``PeerPoolsMixin._refused_sessions``: F9, F18; where
    several fixes refused it, the lowest-numbered one's), else None; None too for a room stock
    returns early for (unknown, or already Failed). Scheduler thread, once per chunk."""
    refused = mgr._refused_sessions
    if not refused:
        return None
    # .get: a transfer thread may pop the room concurrently.
    infos = mgr.transfer_infos.get(room)
    if not infos or mgr.request_status.get(room, KVPoll.Failed) == KVPoll.Failed:
        return None
    for session, info in list(infos.items()):
        by_fix = None if info.is_dummy else refused.get(session)
        if by_fix:
            fix = min(by_fix, key=lambda f: int(f[1:]))
            return (session, fix) + by_fix[fix]
    return None


def conclude_room_failed(mgr, room, reason: str) -> None:
    """Prefill: end ``room`` Failed with ``reason`` and tell each of its non-dummy decode ranks.

    Stock ``conclude_failure`` where the release has it (0.5.23); before, what it
    does there, by hand: record the reason, set the status, send each decode rank
    stock's status message (``sync_status_to_decode_endpoint``, which
    :class:`PeerPoolsMixin` extends with the reason for an ``-ext`` decode).
    """
    if releases.features().mooncake_conclude_failure:
        mgr.conclude_failure(bootstrap_room=room, failure_reason=reason)
        return
    mgr.record_failure(room, reason)
    mgr.update_status(room, KVPoll.Failed)
    rank = prefill_unique_rank(mgr.attn_tp_rank, mgr.pp_rank, mgr.pp_size, mgr.attn_cp_rank, mgr.attn_cp_size)
    for info in list(mgr.transfer_infos.get(room, {}).values()):
        if not info.is_dummy:
            mgr.sync_status_to_decode_endpoint(info.endpoint, info.dst_port, room, KVPoll.Failed, rank)


class PeerPoolsMixin:
    """Publishes (decode) and notes (prefill) each decode's pool sizes; see the module docstring."""

    # Stock Mooncake's status message is (room, status, rank): decode learns
    # only "Failed" and reports SGLang's generic "prefill might be dead". With
    # this, prefill appends the reason frame that SGLang's common
    # ``parse_kv_status_message`` already reads on any decode (stock included),
    # so decode can say why a request was refused.
    kv_status_msg_carries_reason = True

    def __init__(self, *args, **kwargs):
        """Contract: as ``MooncakeKVManager.__init__`` (scheduler thread, startup, once per
        process). The stock constructor starts prefill's bootstrap thread, which
        may read a registration at once, so the table exists before ``super()``.
        """
        # session id -> PoolBounds; written by the bootstrap thread, read by
        # the scheduler thread (single dict operations, no lock needed).
        self._peer_bounds = {}
        self._unchecked_peers = set()
        # Prefill, before 0.5.20's codec: (host, port) of each decode that
        # published pool sizes (so it reads a reason frame). Decode: room -> the
        # reason prefill sent with its Failed status, until stock records it.
        self._reason_endpoints = set()
        self._digest_endpoints = set()  # of those, the ones that read a digest frame (verified transfers)
        self._peer_reasons = {}
        # Prefill: decode sessions refused at registration, session -> {fix: (metric reason,
        # reason)}. Written by the bootstrap thread (each change replaces the session's dict
        # whole), read by the scheduler and transfer threads: single dict operations, no lock.
        self._refused_sessions = {}
        super().__init__(*args, **kwargs)

    # -- prefill: sessions refused at registration (F9, F18) -----------------
    def _refuse_session(self, session: str, fix: str, metric_reason: str, reason: str) -> None:
        """Record that ``fix`` refuses decode ``session`` (bootstrap thread, at its registration):
        every request to it ends Failed with ``reason`` (:meth:`add_transfer_request`)."""
        self._refused_sessions[session] = {**self._refused_sessions.get(session, {}), fix: (metric_reason, reason)}

    def _accept_session(self, session: str, fix: str) -> None:
        """``fix`` no longer refuses ``session`` (it registered again and passed): served unless
        another fix still refuses it. Bootstrap thread."""
        left = {f: v for f, v in self._refused_sessions.get(session, {}).items() if f != fix}
        if left:
            self._refused_sessions[session] = left
        else:
            self._refused_sessions.pop(session, None)

    def add_transfer_request(self, bootstrap_room, *args, **kwargs):
        """Stock ``add_transfer_request``, unless a decode session of the room was refused at registration.

        Contract: prefill only, on the scheduler thread, once per chunk
        (``MooncakeKVSender.send``) after the room reached WaitingForInput, so
        ``transfer_infos[room]`` holds every decode rank's session. Stock
        returns early for a Failed room and queues the chunk for a transfer
        thread otherwise. A room with a refused session is concluded Failed
        here (:func:`conclude_room_failed`: reason recorded, status set, every
        non-dummy decode rank told) and nothing is queued; later chunks of it go
        to stock, which drops them (the room is Failed). Must not raise: the
        scheduler thread would die.
        """
        hit = refused_session(self, bootstrap_room)
        if hit is None:
            return super().add_transfer_request(bootstrap_room, *args, **kwargs)
        session, fix, metric_reason, reason = hit
        # The session's one ERROR was logged at registration; SGLang's scheduler
        # reports each failed request itself.
        logger.debug("room %s refused (%s, decode session %s): %s", bootstrap_room, fix, session, reason)
        metrics.count("requests_refused_total", fix=fix, reason=metric_reason)
        conclude_room_failed(self, bootstrap_room, reason)
        return None

    def send_aux(self, req, *args, **kwargs):
        """Stock ``send_aux``, but ``-1`` and no write for a decode session refused at registration.

        Contract: prefill only. SGLang's ``transfer_worker`` thread calls it on a
        room's last chunk, once per non-dummy decode rank, after that rank's KV
        pages (and state) went out; its rc is that rank's poll (non-zero: the
        worker concludes the room Failed for every rank). Requests of a refused
        session never get here (:meth:`add_transfer_request`); this covers a chunk
        queued before the session registered again with what prefill cannot
        serve. Never raise: the worker re-raises and its thread dies.
        """
        if req.mooncake_session_id in self._refused_sessions:
            return -1
        return super().send_aux(req, *args, **kwargs)

    # -- decode: publish the pool sizes --------------------------------------
    def build_receiver_registration_message(self):
        """Stock's registration frames plus one trailing pool-bounds frame.

        Contract: decode only. ``CommonKVReceiver._register_kv_args`` calls it on
        the scheduler thread when a receiver first reaches a prefill, and sends
        the frames to every prefill rank of that bootstrap address. It may
        assume ``kv_args`` is filled; it must not reorder or drop stock's frames
        (a stock prefill parses them by position and ignores what follows).
        """
        frames = list(super().build_receiver_registration_message())
        frame = pool_bounds_frame(self.kv_args, logger, reads_digests=bool(getattr(self, "_verify_on", False)),
                                  mgr=self)
        return frames if frame is None else frames + [frame]

    # -- prefill: read them -----------------------------------------------------
    def _make_worker_recv(self, *args, **kwargs):
        """Stock's receive function, noting each decode registration's pool sizes.

        Contract: both sides call it once per worker thread at startup
        (``start_prefill_thread`` / ``start_decode_thread``); the function it
        returns runs on that thread for every message, and its result goes
        unchanged to stock's handling (``None`` = nothing received). The wrapper
        only reads prefill's registration messages; it must never raise into
        the bootstrap thread, which would end it.
        """
        recv = super()._make_worker_recv(*args, **kwargs)
        # 0.5.21-0.5.22 build this receive function over ``server_socket`` too,
        # which :meth:`start_prefill_thread` wrapped: it notes each registration
        # once there, so noting it here as well would note it twice.
        if self.disaggregation_mode.name != "PREFILL" or not releases.features().mooncake_registration_hooks:
            return recv

        def recv_noting_bounds():
            msg = recv()
            if msg and len(msg) > 3 and msg[0] == REGISTRATION:
                self._note_registration(msg)
            return msg

        return recv_noting_bounds

    def start_prefill_thread(self):
        """Stock's prefill bootstrap thread, reading through a socket that notes pool sizes.

        Contract: prefill only; the stock constructor calls it once, after
        ``CommonKVManager.__init__`` bound ``server_socket`` and before any decode
        can register. Up to 0.5.22 the thread reads ``self.server_socket`` on
        every message (0.5.21-0.5.22 through ``_make_worker_recv`` of it), so the
        wrapper sees each one first and hands it on unchanged; it must never
        raise into that thread. On 0.5.23 (the decode publishes through
        ``build_receiver_registration_message``) ``_make_worker_recv`` notes it
        and the socket is left alone.
        """
        if not releases.features().mooncake_registration_hooks:
            self.server_socket = FilteringSocket(self.server_socket, self._note_if_registration, logger)
        return super().start_prefill_thread()

    def _note_if_registration(self, msg) -> None:
        if msg and len(msg) > 3 and msg[0] == REGISTRATION:
            self._note_registration(msg)

    def _note_registration(self, msg) -> None:
        try:
            session = bytes(msg[3]).decode("ascii")
        except UnicodeDecodeError:
            return  # stock's own parse of this message reports it
        note_peer_bounds(
            self._peer_bounds, self._unchecked_peers, session, msg, logger, "decode session",
            "decode session %s published no pool sizes (a stock decode): destination index checks are off "
            "for it (a request with an out-of-pool index fails its whole session, as in stock SGLang), and "
            "its metadata buffers are checked by count only",
        )
        if releases.features().kv_status_codec:
            return  # 0.5.20+: stock's status message carries the reason to any decode
        try:
            endpoint = (bytes(msg[1]).decode("ascii"), int(bytes(msg[2]).decode("ascii")))
        except (UnicodeDecodeError, ValueError):
            return  # stock's own parse of this message reports it
        # A decode that publishes pool sizes is this plugin's: it takes a reason frame
        # (and a digest frame where it says it verifies).
        bounds = self._peer_bounds.get(session)
        if bounds is not None:
            self._reason_endpoints.add(endpoint)
        else:
            self._reason_endpoints.discard(endpoint)
        if bounds is not None and bounds.reads_digests:
            self._digest_endpoints.add(endpoint)
        else:
            self._digest_endpoints.discard(endpoint)

    # -- failure reasons to decode (releases without 0.5.22's status codec) ----
    def sync_status_to_decode_endpoint(self, remote, dst_port, room, status, prefill_rank):
        """Stock's status message; a Failed one to an ``-ext`` decode also carries the reason.

        Contract: prefill only, from the transfer threads and (refusals) the
        scheduler thread, once per decode rank when a room concludes, after the
        reason was recorded (``record_failure``). Stock's three frames (room,
        status, rank) go out as stock sends them; a fourth frame, the reason,
        only where the release's decode loop unpacks exactly three frames and
        this decode published pool sizes (it takes the frame off, see
        :meth:`start_decode_thread`). Must not raise more than stock does.
        """
        reason = None
        if int(status) == int(KVPoll.Failed) and (remote, int(dst_port)) in self._reason_endpoints:
            with self.failure_lock:
                reason = self.failure_records.get(room)
        if reason is None or releases.features().kv_status_codec:
            return super().sync_status_to_decode_endpoint(remote, dst_port, room, status, prefill_rank)
        self._send_status_with(remote, dst_port, room, status, prefill_rank,
                               REASON_PREFIX + str(reason).encode("utf-8", "replace"))

    def _send_status_with(self, remote, dst_port, room, status, prefill_rank, extra: bytes, *more: bytes) -> None:
        """Stock's status message to a decode endpoint (up to 0.5.19 ``sync_status_to_decode_endpoint``
        sends the same three frames: room, status, prefill rank) plus a fourth frame ``extra``
        (a reason here, a digest in ``verify``, then ``more``: its reply address),
        which only an ``-ext`` decode's filter takes off. Raises what stock's send raises."""
        from sglang.srt.utils.network import NetworkAddress

        na = NetworkAddress(remote, dst_port)
        self._connect(na.to_tcp(), is_ipv6=na.is_ipv6).send_multipart(
            [str(room).encode("ascii"), str(int(status)).encode("ascii"), str(prefill_rank).encode("ascii"), extra,
             *more]
        )

    def start_decode_thread(self):
        """Stock's decode thread, reading through a socket that takes off a reason frame.

        Contract: decode only; the stock constructor calls it once, after
        ``server_socket`` is bound and before any prefill knows this decode. Up to
        0.5.19 the thread reads ``self.server_socket`` on every message and
        unpacks a status message as exactly three frames: the wrapper removes the
        fourth an ``-ext`` prefill adds and keeps the reason for
        :meth:`record_failure`, handing every other message on unchanged. It must
        never raise into that thread. 0.5.20+ parse the reason themselves.
        """
        if not releases.features().kv_status_codec:
            self.server_socket = FilteringSocket(self.server_socket, self._take_status_frame, logger)
        return super().start_decode_thread()

    def _take_status_frame(self, msg):
        """A status message's fourth frame from an ``-ext`` prefill (reason or digest), taken
        off; None for any other message (handed on unchanged)."""
        if len(msg) not in (4, 5):
            return None
        extra = bytes(msg[3])
        if len(msg) == 5 and not extra.startswith(DIGEST_PREFIX):
            return None
        if extra.startswith(REASON_PREFIX):
            room = int(bytes(msg[0]).decode("ascii"))
            self._peer_reasons[room] = extra[len(REASON_PREFIX):].decode("utf-8", "replace")
            return msg[:3]
        if extra.startswith(DIGEST_PREFIX):
            self._keep_digest_frame(int(bytes(msg[0]).decode("ascii")), int(bytes(msg[2]).decode("ascii")),
                                    extra[len(DIGEST_PREFIX):], bytes(msg[4]) if len(msg) == 5 else None)
            return msg[:3]
        return None

    def _keep_digest_frame(self, room: int, prefill_rank: int, frame: bytes, reply: Optional[bytes]) -> None:
        """A prefill rank's digest for ``room`` and its reply address (None where it sent none;
        decode's status thread); the verified-transfer mixin keeps them. Here (not verifying:
        this decode never asked for one) they are dropped."""

    def record_failure(self, bootstrap_room, failure_reason):
        """Stock ``record_failure``; on decode, prefill's own reason where it sent one.

        Contract: any thread (stock's decode thread records "Failed to get kvcache
        from prefill instance, it might be dead" for every Failed status); it
        must not raise. A reason prefill sent with that status (see
        :meth:`start_decode_thread`) is recorded instead, once.
        """
        sent = self._peer_reasons.pop(bootstrap_room, None)
        if sent is not None and self.disaggregation_mode == DisaggregationMode.DECODE:
            failure_reason = f"prefill failed the request: {sent}"
        return super().record_failure(bootstrap_room, failure_reason)


class MooncakeExtKVReceiver(MooncakeKVReceiver):
    """Stock receiver whose registration also carries decode's pool sizes (0.5.10.post1-0.5.22)."""

    def _register_kv_args(self):
        """Stock registration, with one trailing pool-bounds frame.

        Contract: decode only, on the scheduler thread, when a receiver first
        meets a prefill bootstrap address; stock sends one message per prefill
        rank through ``_connect_to_bootstrap_server``'s cached sockets. Stock's
        frames go out unchanged and in order: a stock prefill parses them by
        position (``KVArgsRegisterInfo.from_zmq``, up to its staging fields) and
        never reads the trailing one.
        """
        frame = pool_bounds_frame(self.kv_mgr.kv_args, logger,
                                  reads_digests=bool(getattr(self.kv_mgr, "_verify_on", False)),
                                  mgr=self.kv_mgr)
        if frame is None:
            return super()._register_kv_args()
        return register_appending(self, frame, _is_registration, super()._register_kv_args)


def _is_registration(frames) -> bool:
    return len(frames) > 3 and bytes(frames[0]) == REGISTRATION
