"""Prefill: decode's metadata for a room prefill dropped or never admitted ends Failed (F17 on
Mooncake, F24 on NIXL).

Stock (every release 0.5.10.post1-0.5.23, both engines): a prefill request that waits in
Bootstrapping past SGLang's bootstrap timeout (or is aborted there) ends Failed
on prefill only; with no decode address for the room yet, prefill tells decode
nothing. When decode's metadata for the room arrives later, prefill's bootstrap
thread stores it (``transfer_infos[room]``: Mooncake 0.5.23 mooncake/conn.py:3013-3034,
NIXL nixl/conn.py:3392-3411) for a room no request will serve, and
decode holds the request's KV pages and metadata slot until its own waiting
timeout (300 s by default) before it ends the request Failed with SGLang's
generic reason.

Here prefill remembers the rooms it failed while still Bootstrapping
(``core.dropped_rooms``), and the bootstrap thread answers decode's metadata for
such a room with Failed and the reason, through SGLang's own status message,
instead of storing it: decode frees the request at once. A new request that
opens the same room again takes it off the list. Counted in
``requests_refused_total{fix=<id>,reason="room dropped by prefill"}``; one
WARNING a minute at most.

The same bootstrap thread also stores decode's metadata for a room no request
ever opened on this prefill (the request to prefill was refused before its
scheduler, or never sent) and marks it WaitingForInput: prefill keeps that
entry for ever and decode waits out its waiting timeout. Here such a room is
held for a lease of SGLang's bootstrap timeout (how long a request that did
open the room would have waited for decode): if no request opens it by then,
prefill drops its entries for the room and answers every decode rank that
wrote it with Failed and the reason (``reason="room never admitted by
prefill"``). A sweeper thread, one per prefill manager, checks once a second.

The reverse orphan (decode ended the room before the request reached this prefill's
scheduler): ``backends.common.ended_first``, whose mixin this one extends.

Built on ``_handle_abort_notification`` (the one call the bootstrap loop makes on every
per-room decode message before it stores anything, returning whether the message was
consumed: Mooncake 0.5.22+, NIXL 0.5.16+) and ``send_kv_status_message``, which a decode
reads as a Failed room with the reason (Mooncake 0.5.22+ through this hook, NIXL 0.5.20+).
Each engine's module says where its per-room message keeps the room and decode's endpoint
(``_room_and_endpoint``); elsewhere the fix is "live, not covered" (the release table in
``releases``).
"""

from __future__ import annotations

import logging
import threading
import time

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_disagg_ext import metrics
from sglang_disagg_ext.backends.common.ended_first import EndedFirstMixin
from sglang_disagg_ext.backends.common.room_claims import claims_of
from sglang_disagg_ext.core.dropped_rooms import DroppedRooms, PendingRooms, never_admitted_reason
from sglang_disagg_ext.core.rate_limit import EveryInterval

logger = logging.getLogger("sglang_disagg_ext.dropped_rooms")

REFUSAL_LABEL = "room dropped by prefill"
NEVER_ADMITTED_LABEL = "room never admitted by prefill"
SWEEP_INTERVAL_S = 1.0
_LOG = EveryInterval(60.0)


def room_and_endpoint(frames, min_frames: int):
    """Room and decode's (host, port) from a per-room metadata message's frames (room, endpoint,
    port, ...: both engines' ``TransferInfo.from_zmq``), or None for a message of fewer than
    ``min_frames`` frames, a registration (room ``None``) or one that does not parse."""
    if not frames or len(frames) < min_frames:
        return None
    try:
        return int(frames[0].decode("ascii")), (frames[1].decode("ascii"), int(frames[2].decode("ascii")))
    except (AttributeError, UnicodeDecodeError, ValueError):
        return None


class DroppedRoomsMixin(EndedFirstMixin):
    """See the module docstring. Cooperative; composed before the manager class. An engine's
    subclass names its fix ids and reads its per-room message (``_room_and_endpoint``)."""

    DROPPED_ROOMS_FIX = "?"  # the fix id the metric carries

    def __init__(self, *args, **kwargs):
        """Contract: as the manager's ``__init__`` (scheduler thread, startup, once per
        process). The stock constructor starts prefill's bootstrap thread, which reads the
        tables, so they exist before ``super()``; the sweeper starts after it, on prefill.
        ``_rooms_lock`` (``EndedFirstMixin``) also serialises these tables, and the sweeper's
        release against both threads."""
        self._rooms_dropped = DroppedRooms()
        self._rooms_pending = PendingRooms()
        super().__init__(*args, **kwargs)
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            threading.Thread(target=self._lease_sweep, daemon=True,
                             name=f"sglang-disagg-ext {self.DROPPED_ROOMS_FIX} room lease").start()

    def update_status(self, bootstrap_room, status):
        """Stock ``update_status``; on prefill, a room failed while Bootstrapping is remembered
        (a room a request opens is taken off both lists in ``_room_opened``).

        Contract: SGLang calls it on both sides from the scheduler thread (a new sender or
        receiver opens its room Bootstrapping; a sender's bootstrap timeout or abort sets
        Failed), prefill's bootstrap thread (WaitingForInput once every decode rank's
        metadata is in) and its transfer workers (Transferring, Success, Failed). It must
        not raise and must not change what stock records.
        """
        if (status == KVPoll.Failed and self.disaggregation_mode == DisaggregationMode.PREFILL
                and self.request_status.get(bootstrap_room) == KVPoll.Bootstrapping):
            # Still Bootstrapping: decode's metadata has not all arrived, so no decode rank
            # will hear of this failure from stock.
            self._rooms_dropped.drop(bootstrap_room, self.failure_records.get(bootstrap_room))
        return super().update_status(bootstrap_room, status)

    def _room_and_endpoint(self, msg) -> "tuple[int, tuple[str, int]] | None":
        """The room and decode's status endpoint (host, port) of a per-room metadata message, or
        None for any other message (a registration names room ``None``) or one that does not parse."""
        raise NotImplementedError

    def _room_opened(self, room) -> None:
        self._rooms_dropped.reopen(room)
        self._rooms_pending.take(room)

    def _handle_abort_notification(self, msg) -> bool:
        """Stock's abort handling (with the reverse orphan noted, ``EndedFirstMixin``), then
        decode's metadata for a dropped room answered with Failed, and metadata for a room no
        request holds noted for the lease.

        Contract: prefill only. The bootstrap thread calls it for every decode
        message but the staging ones, before it reads the room; True means the message
        was consumed and stock stores nothing for it. Runs on that thread: must not block
        on anything but sending the one status message, and must not raise.
        """
        if super()._handle_abort_notification(msg):
            return True
        parsed = self._room_and_endpoint(msg)
        if parsed is None:
            return False  # not per-room metadata, or stock's parse will say what is wrong with it
        room, target = parsed
        with self._rooms_lock:
            status = self.request_status.get(room)
            reason = self._rooms_dropped.refusal(room) if status in (None, KVPoll.Failed) else None
            if reason is None:
                if status is None:
                    self._rooms_pending.note(room, target)
                return False  # stock stores it (for a live request, or pending the lease)
        self._refuse_room(room, [target], reason, REFUSAL_LABEL)
        return True

    def _lease_sweep(self) -> None:
        """Prefill's lease: a room pending longer than SGLang's bootstrap timeout is released."""
        while not getattr(self, "_stopped", False):
            time.sleep(SWEEP_INTERVAL_S)
            try:
                lease_s = float(self.bootstrap_timeout)
                with self._rooms_lock:
                    expired = self._rooms_pending.expired(lease_s)
                for room, waited_s in expired:
                    with self._rooms_lock:
                        targets = self._rooms_pending.take(room)
                        if targets is None or claims_of(self, "prefill").holder(room) is not None:
                            continue  # a request opened it meanwhile (F16's claim: any sender, dummy ranks too)
                        # Stock's entries for a room no request holds: its page lists, and the
                        # WaitingForInput status the bootstrap thread gave it.
                        self.transfer_infos.pop(room, None)
                        self.req_to_decode_prefix_len.pop(room, None)
                        if self.request_status.get(room) == KVPoll.WaitingForInput:
                            self.request_status.pop(room, None)
                    self._refuse_room(room, sorted(targets), never_admitted_reason(room, waited_s),
                                     NEVER_ADMITTED_LABEL)
            except Exception:  # noqa: BLE001 - the lease must outlive one bad sweep
                logger.exception("%s room lease sweep failed; retrying in %.0f s", self.DROPPED_ROOMS_FIX, SWEEP_INTERVAL_S)

    def _refuse_room(self, room, targets, reason: str, label: str) -> None:
        """Tell each decode endpoint ``room`` is Failed with ``reason``; count it; never raises."""
        metrics.count("requests_refused_total", fix=self.DROPPED_ROOMS_FIX, reason=label)
        held_back = _LOG.admit(label)
        if held_back is not None:
            more = f" ({held_back} more since the last such line)" if held_back else ""
            logger.warning("decode %s: %s%s", ", ".join(f"{h}:{p}" for h, p in targets), reason, more)
        try:
            self.send_kv_status_message(targets=list(targets), bootstrap_room=room, status=KVPoll.Failed,
                                        failure_reason=reason)
        except Exception:  # noqa: BLE001 - a dead decode must not end the calling thread
            logger.exception("room %s: could not tell decode %s it was refused", room, targets)
