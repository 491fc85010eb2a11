"""F17 mixin for ``mooncake-ext``: decode's metadata for a room prefill dropped or never admitted ends Failed.

Stock (every release 0.5.10.post1-0.5.23): a prefill request that waits in
Bootstrapping past SGLang's bootstrap timeout (or is aborted there) ends Failed
on prefill only; with no decode address for the room yet, prefill tells decode
nothing. When decode's metadata for the room arrives later, prefill's bootstrap
thread stores it (``transfer_infos[room]``) for a room no request will serve, and
decode holds the request's KV pages and metadata slot until its own waiting
timeout (300 s by default) before it ends the request Failed with SGLang's
generic reason.

Here prefill remembers the rooms it failed while still Bootstrapping
(``core.dropped_rooms``), and the bootstrap thread answers decode's metadata for
such a room with Failed and the reason, through SGLang's own status message,
instead of storing it: decode frees the request at once. A new request that
opens the same room again takes it off the list. Counted in
``requests_refused_total{fix="F17",reason="room dropped by prefill"}``; one
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
scheduler): ``backends.common.ended_first``, under this fix's id on Mooncake
(``reason="room ended by decode before prefill opened it"``).

Built on 0.5.22's ``_handle_abort_notification`` (the one call the bootstrap loop
makes on every per-room decode message before it stores anything, returning
whether the message was consumed) and ``send_kv_status_message``; older
releases have neither, and F17 is "live, not covered" there (the release table in ``releases``).
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

logger = logging.getLogger("sglang_disagg_ext.mooncake.dropped_rooms")

REFUSAL_LABEL = "room dropped by prefill"
NEVER_ADMITTED_LABEL = "room never admitted by prefill"
SWEEP_INTERVAL_S = 1.0
_LOG = EveryInterval(60.0)


def metadata_room(msg) -> "int | None":
    """The room of a decode per-room metadata message (room, endpoint, port, session, ...,
    ``required_dst_info_num`` in frame 7), or None for anything else (a registration names
    room ``None``)."""
    if not msg or len(msg) < 8:
        return None
    try:
        return int(msg[0].decode("ascii"))
    except (AttributeError, UnicodeDecodeError, ValueError):
        return None


class DroppedRoomsMixin(EndedFirstMixin):
    """F17: see the module docstring. Cooperative; composed before the manager class."""

    ENDED_FIRST_FIX = "F17"

    def __init__(self, *args, **kwargs):
        """Contract: as ``MooncakeKVManager.__init__`` (scheduler thread, startup, once per
        process). The stock constructor starts prefill's bootstrap thread, which reads the
        tables, so they exist before ``super()``; the sweeper starts after it, on prefill.
        ``_rooms_lock`` (``EndedFirstMixin``) also serialises these tables, and the sweeper's
        release against both threads."""
        self._f17_dropped = DroppedRooms()
        self._f17_pending = PendingRooms()
        super().__init__(*args, **kwargs)
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            threading.Thread(target=self._f17_sweep, name="sglang-disagg-ext F17 room lease", daemon=True).start()

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
            self._f17_dropped.drop(bootstrap_room, self.failure_records.get(bootstrap_room))
        return super().update_status(bootstrap_room, status)

    def _room_opened(self, room) -> None:
        self._f17_dropped.reopen(room)
        self._f17_pending.take(room)

    def _handle_abort_notification(self, msg) -> bool:
        """Stock's abort handling (with the reverse orphan noted, ``EndedFirstMixin``), then
        decode's metadata for a dropped room answered with Failed, and metadata for a room no
        request holds noted for the lease.

        Contract: prefill only (0.5.22+). The bootstrap thread calls it for every decode
        message but the staging ones, before it reads the room; True means the message
        was consumed and stock stores nothing for it. Runs on that thread: must not block
        on anything but sending the one status message, and must not raise.
        """
        if super()._handle_abort_notification(msg):
            return True
        room = metadata_room(msg)
        if room is None:
            return False  # not per-room metadata
        try:
            target = (msg[1].decode("ascii"), int(msg[2].decode("ascii")))
        except (UnicodeDecodeError, ValueError):
            return False  # stock's parse will say what is wrong with it
        with self._rooms_lock:
            status = self.request_status.get(room)
            reason = self._f17_dropped.refusal(room) if status in (None, KVPoll.Failed) else None
            if reason is None:
                if status is None:
                    self._f17_pending.note(room, target)
                return False  # stock stores it (for a live request, or pending the lease)
        self._f17_refuse(room, [target], reason, REFUSAL_LABEL)
        return True

    def _f17_sweep(self) -> None:
        """Prefill's lease: a room pending longer than SGLang's bootstrap timeout is released."""
        while not getattr(self, "_stopped", False):
            time.sleep(SWEEP_INTERVAL_S)
            try:
                lease_s = float(self.bootstrap_timeout)
                with self._rooms_lock:
                    expired = self._f17_pending.expired(lease_s)
                for room, waited_s in expired:
                    with self._rooms_lock:
                        targets = self._f17_pending.take(room)
                        if targets is None or claims_of(self, "prefill").holder(room) is not None:
                            continue  # a request opened it meanwhile (F16's claim: any sender, dummy ranks too)
                        # Stock's entries for a room no request holds: its page lists, and the
                        # WaitingForInput status the bootstrap thread gave it.
                        self.transfer_infos.pop(room, None)
                        self.req_to_decode_prefix_len.pop(room, None)
                        if self.request_status.get(room) == KVPoll.WaitingForInput:
                            self.request_status.pop(room, None)
                    self._f17_refuse(room, sorted(targets), never_admitted_reason(room, waited_s),
                                     NEVER_ADMITTED_LABEL)
            except Exception:  # noqa: BLE001 - the lease must outlive one bad sweep
                logger.exception("F17 room lease sweep failed; retrying in %.0f s", SWEEP_INTERVAL_S)

    def _f17_refuse(self, room, targets, reason: str, label: str) -> None:
        """Tell each decode endpoint ``room`` is Failed with ``reason``; count it; never raises."""
        metrics.count("requests_refused_total", fix="F17", reason=label)
        held_back = _LOG.admit(label)
        if held_back is not None:
            more = f" ({held_back} more since the last such line)" if held_back else ""
            logger.warning("decode %s: %s%s", ", ".join(f"{h}:{p}" for h, p in targets), reason, more)
        try:
            self.send_kv_status_message(targets=list(targets), bootstrap_room=room, status=KVPoll.Failed,
                                        failure_reason=reason)
        except Exception:  # noqa: BLE001 - a dead decode must not end the calling thread
            logger.exception("room %s: could not tell decode %s it was refused", room, targets)
