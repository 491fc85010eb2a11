"""F17 mixin for ``mooncake-ext``: decode's metadata for a room prefill already dropped is refused at once.

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

Built on 0.5.22's ``_handle_abort_notification`` (the one call the bootstrap loop
makes on every per-room decode message before it stores anything, returning
whether the message was consumed) and ``send_kv_status_message``; older
releases have neither, and F17 stays live there (``releases.FIX_ROWS``).
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_disagg_ext import metrics
from sglang_disagg_ext.core.dropped_rooms import DroppedRooms
from sglang_disagg_ext.core.rate_limit import EveryInterval

logger = logging.getLogger("sglang_disagg_ext.mooncake.dropped_rooms")

REFUSAL_LABEL = "room dropped by prefill"
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


class DroppedRoomsMixin:
    """F17: see the module docstring. Cooperative; composed before the manager class."""

    def __init__(self, *args, **kwargs):
        """Contract: as ``MooncakeKVManager.__init__`` (scheduler thread, startup, once per
        process). The stock constructor starts prefill's bootstrap thread, which reads the
        table, so it exists before ``super()``."""
        self._f17_dropped = DroppedRooms()
        super().__init__(*args, **kwargs)

    def update_status(self, bootstrap_room, status):
        """Stock ``update_status``; on prefill, a room failed while Bootstrapping is remembered.

        Contract: SGLang calls it on both sides from the scheduler thread (a new sender or
        receiver opens its room Bootstrapping; a sender's bootstrap timeout or abort sets
        Failed), prefill's bootstrap thread (WaitingForInput once every decode rank's
        metadata is in) and its transfer workers (Transferring, Success, Failed). It must
        not raise and must not change what stock records.
        """
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            current = self.request_status.get(bootstrap_room)
            if current is None and status == KVPoll.Bootstrapping:
                self._f17_dropped.reopen(bootstrap_room)
            elif current == KVPoll.Bootstrapping and status == KVPoll.Failed:
                # Still Bootstrapping: decode's metadata has not all arrived, so no decode
                # rank will hear of this failure from stock.
                self._f17_dropped.drop(bootstrap_room, self.failure_records.get(bootstrap_room))
        return super().update_status(bootstrap_room, status)

    def _handle_abort_notification(self, msg) -> bool:
        """Stock's abort handling, then decode's metadata for a dropped room answered with Failed.

        Contract: prefill only (0.5.22+). The bootstrap thread calls it for every decode
        message but the staging ones, before it reads the room; True means the message
        was consumed and stock stores nothing for it. Runs on that thread: must not block
        on anything but sending the one status message, and must not raise.
        """
        if super()._handle_abort_notification(msg):
            return True
        room = metadata_room(msg)
        if room is None or self.request_status.get(room) not in (None, KVPoll.Failed):
            return False  # not per-room metadata, or a live request holds the room
        reason = self._f17_dropped.refusal(room)
        if reason is None:
            return False
        try:
            target = (msg[1].decode("ascii"), int(msg[2].decode("ascii")))
        except (UnicodeDecodeError, ValueError):
            return False  # stock's parse will say what is wrong with it
        metrics.count("requests_refused_total", fix="F17", reason=REFUSAL_LABEL)
        held_back = _LOG.admit("F17")
        if held_back is not None:
            more = f" ({held_back} more since the last such line)" if held_back else ""
            logger.warning("decode %s:%s: %s%s", target[0], target[1], reason, more)
        try:
            self.send_kv_status_message(targets=[target], bootstrap_room=room, status=KVPoll.Failed,
                                        failure_reason=reason)
        except Exception:  # noqa: BLE001 - a dead decode must not end the bootstrap thread
            logger.exception("room %s: could not tell decode %s:%s it was refused", room, *target)
        return True
