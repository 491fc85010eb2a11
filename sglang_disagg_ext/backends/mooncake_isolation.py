"""F6 for ``mooncake-ext``: one bad request never poisons a decode peer's session.

Stock prefill hands decode's indices to the engine unchecked. An index
outside decode's pool makes the transfer fail, and the transfer worker then
puts decode's whole Mooncake session into ``failed_sessions`` after that one
failure: every following request to that decode fails ("remote mooncake
session ... is not alive") until a probe succeeds (30 s, backing off to
300 s) or decode registers again.

Here:

* decode appends its pool sizes (:mod:`..core.index_bounds`) as one extra,
  trailing frame of its registration message; stock ``KVArgsRegisterInfo.from_zmq``
  reads fixed positions and ignores it, so a stock prefill is unaffected;
* prefill reads that frame when present and checks each request's KV, aux
  and state destination indices in ``add_transfer_request``, before the room
  is queued for the engine. A bad index ends the room Failed on prefill and,
  through stock's own status message, on every decode rank of the room, with
  a reason naming the component, the index and the pool size. The session is
  not marked: the next request to the same decode is served;
* a peer that published no sizes (stock decode) gets stock behaviour and one
  INFO line saying so at its registration;
* a transfer that fails for any other reason (the peer really gone) still
  marks the session, exactly as stock does: nothing in that path changes.

Needs the 0.5.23 manager hooks (``build_receiver_registration_message``,
``_make_worker_recv``, ``conclude_failure``). On releases whose decode builds
the registration inside the receiver (0.5.12.post1 and older) no sizes are
published, so every peer is "unchecked" and this mixin changes nothing.
"""

from __future__ import annotations

import logging

from sglang_disagg_ext.core.index_bounds import (
    IndexBoundsError,
    bounds_in_message,
    bounds_of,
    check_destination,
    encode_frame,
)

logger = logging.getLogger("sglang_disagg_ext.mooncake.isolation")

# First frame of a decode registration message (stock: the room field reads "None").
_REGISTRATION = b"None"


class RequestIsolationMixin:
    """Refuses a request whose decode indices fall outside decode's pools; see the module docstring."""

    # Stock Mooncake's status message is (room, status, rank): decode learns
    # only "Failed" and reports SGLang's generic "prefill might be dead". With
    # this, prefill appends the reason frame that SGLang's common
    # ``parse_kv_status_message`` already reads on any decode (stock included),
    # so decode can say which index of which component was refused.
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
        super().__init__(*args, **kwargs)

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
        args = self.kv_args
        try:
            bounds = bounds_of(
                args.kv_data_lens,
                args.kv_item_lens,
                args.aux_data_lens,
                args.aux_item_lens,
                getattr(args, "state_data_lens", None) or [],
                getattr(args, "state_item_lens", None) or [],
            )
        except IndexBoundsError as exc:
            # Registration must still go out: the peer then runs unchecked.
            logger.error("not publishing pool sizes to prefill: %s", exc)
            return frames
        return frames + [encode_frame(bounds)]

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
        if self.disaggregation_mode.name != "PREFILL":
            return recv

        def recv_noting_bounds():
            msg = recv()
            if msg and len(msg) > 3 and msg[0] == _REGISTRATION:
                self._note_registration(msg)
            return msg

        return recv_noting_bounds

    def _note_registration(self, msg) -> None:
        try:
            session = bytes(msg[3]).decode("ascii")
        except UnicodeDecodeError:
            return  # stock's own parse of this message reports it
        try:
            bounds = bounds_in_message(msg)
        except IndexBoundsError as exc:
            logger.error("decode session %s sent a malformed pool-sizes frame (%s); its requests are not checked",
                         session, exc)
            bounds = None
        if bounds is not None:
            self._peer_bounds[session] = bounds
            self._unchecked_peers.discard(session)
            return
        self._peer_bounds.pop(session, None)
        if session not in self._unchecked_peers:
            self._unchecked_peers.add(session)
            logger.info(
                "decode session %s published no pool sizes (a stock decode): destination index checks are off "
                "for it, and a request with an out-of-pool index fails its whole session as in stock SGLang",
                session,
            )

    def add_transfer_request(self, bootstrap_room, *args, **kwargs):
        """Stock ``add_transfer_request``, after checking decode's indices for the room.

        Contract: prefill only, on the scheduler thread, once per chunk
        (``MooncakeKVSender.send``) after the room reached WaitingForInput, so
        ``transfer_infos[room]`` holds every decode rank's indices. Stock
        returns early for a Failed room and queues the chunk for a transfer
        thread otherwise. A refused room is concluded Failed here (stock's
        ``conclude_failure``: reason recorded, status set, every non-dummy decode
        rank told) and nothing is queued; the session is never marked. Must not
        raise for a bad index: the scheduler thread would die.
        """
        reason = self._destination_problem(bootstrap_room)
        if reason is None:
            return super().add_transfer_request(bootstrap_room, *args, **kwargs)
        logger.error("room %s refused before transfer: %s", bootstrap_room, reason)
        self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=reason)
        return None

    def _destination_problem(self, room):
        # .get: a transfer thread may pop the room concurrently.
        infos = self.transfer_infos.get(room)
        if room not in self.request_status or not infos:
            return None  # stock returns early for these
        state_kinds = [getattr(t, "value", t) for t in (getattr(self.kv_args, "state_types", None) or [])]
        for session, info in list(infos.items()):
            if info.is_dummy:
                continue
            bounds = self._peer_bounds.get(session)
            if bounds is None:
                continue
            registration = self.decode_kv_args_table.get(session)
            # DCP relayout addresses decode KV by token, not page: its KV
            # indices are not pool pages.
            kv = None if getattr(registration, "requires_dcp_relayout", False) else info.dst_kv_indices
            reason = check_destination(bounds, kv, info.dst_aux_index, info.dst_state_indices, state_kinds)
            if reason is not None:
                return f"decode session {session}: {reason}"
        return None
