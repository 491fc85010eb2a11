"""Prefill: a room decode ended before any request opened it here fails when a request opens it.

The reverse orphan (F17 on Mooncake 0.5.22+, F23 on NIXL 0.5.16+). Decode ends a room (its
ABORT: a refusal of this prefill, its waiting timeout, an abort) before the request reaches
this prefill's scheduler. Stock's ABORT handler ignores a room it has no status for (0.5.23
``nixl/conn.py`` ``_handle_abort_notification``, ``room_active`` False; 0.5.16 :2360-2377 and
Mooncake 0.5.22+ the same), and the request that opens the room later waits for metadata no
decode will send: out to SGLang's bootstrap timeout (NIXL 0.5.18+, Mooncake), or for ever where
NIXL's sender has no bootstrap deadline (0.5.16, 0.5.17), holding its KV on prefill meanwhile.

Here the bootstrap thread notes such a room (``core.dropped_rooms.CancelledRooms``), and a request
that opens it within SGLang's waiting plus bootstrap timeouts ends Failed at once with a reason
naming the room, counted in ``requests_refused_total{fix=<id>,reason="room ended by decode before
prefill opened it"}``; one WARNING a minute at most. 0.5.23's own ``DeferredBootstrap`` does the
same in its ``prefill_complete`` allocation mode only.

Built on the two calls every such release makes: the bootstrap thread's
``_handle_abort_notification(msg)`` for every decode message before it reads a room (returning
whether the message was consumed), and ``update_status(room, Bootstrapping)``, which a new sender
makes as it opens its room.
"""

from __future__ import annotations

import logging
import threading

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_disagg_ext import metrics
from sglang_disagg_ext.backends.common.metadata_gate import waiting_timeout_s
from sglang_disagg_ext.core.dropped_rooms import CancelledRooms, cancelled_reason
from sglang_disagg_ext.core.prefill_notice import aborted_room
from sglang_disagg_ext.core.rate_limit import EveryInterval

logger = logging.getLogger("sglang_disagg_ext.ended_first")

ENDED_FIRST_LABEL = "room ended by decode before prefill opened it"
_LOG = EveryInterval(60.0)


class EndedFirstMixin:
    """See the module docstring. Cooperative; composed before the manager class."""

    ENDED_FIRST_FIX = "F23"  # the fix id the metric carries (Mooncake's F17 sets its own)

    def __init__(self, *args, **kwargs):
        """Contract: as the manager's ``__init__`` (scheduler thread, startup, once per process).
        The stock constructor starts prefill's bootstrap thread, which reads the table, so it
        exists before ``super()``."""
        self._ended_first = CancelledRooms()
        # Serialises "no request holds this room" + noting it (bootstrap thread) against a request
        # opening it (scheduler thread).
        self._rooms_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def update_status(self, bootstrap_room, status):
        """Stock ``update_status``; on prefill, a request opening a room decode had ended fails it.

        Contract: SGLang calls it on both sides from the scheduler thread (a new sender or receiver
        opens its room Bootstrapping; a timeout or abort sets Failed), prefill's bootstrap thread
        (WaitingForInput) and its transfer workers. It must not raise and must not change what
        stock records for any other room.
        """
        if status != KVPoll.Bootstrapping or self.disaggregation_mode != DisaggregationMode.PREFILL:
            return super().update_status(bootstrap_room, status)
        with self._rooms_lock:  # only a new sender sets Bootstrapping: a request opens the room
            self._room_opened(bootstrap_room)
            # Every request opens a room here: SGLang's two timeouts are read only when some room
            # decode ended first is waiting (almost never).
            ended_s = (self._ended_first.take(bootstrap_room, self._ended_first_ttl_s())
                       if self._ended_first else None)
            out = super().update_status(bootstrap_room, status)
        if ended_s is not None:
            self._fail_ended_first(bootstrap_room, ended_s)
        return out

    def _room_opened(self, room) -> None:
        """A request opened ``room`` (under ``_rooms_lock``, before stock records it). For a mixin
        that keeps more rooms than this one."""

    def _handle_abort_notification(self, msg) -> bool:
        """Decode's ABORT for a room no request has opened here is noted; then stock's handling.

        Contract: prefill only. The bootstrap thread calls it for every decode message but the
        staging ones, before it reads a room; True means the message was consumed. Runs on that
        thread: must not block and must not raise.
        """
        room = aborted_room(msg)
        if room is not None:
            with self._rooms_lock:
                if room not in self.request_status:
                    self._ended_first.note(room, self._ended_first_ttl_s())
        return super()._handle_abort_notification(msg)

    def _ended_first_ttl_s(self) -> float:
        # As 0.5.23's DeferredBootstrap: decode's waiting timeout plus prefill's bootstrap timeout.
        return waiting_timeout_s() + float(self.bootstrap_timeout)

    def _fail_ended_first(self, room, ended_s: float) -> None:
        """A request opened a room decode had ended: Failed now, with the reason (scheduler thread)."""
        reason = cancelled_reason(room, ended_s)
        metrics.count("requests_refused_total", fix=self.ENDED_FIRST_FIX, reason=ENDED_FIRST_LABEL)
        held_back = _LOG.admit(ENDED_FIRST_LABEL)
        if held_back is not None:
            more = f" ({held_back} more since the last such line)" if held_back else ""
            logger.warning("%s%s", reason, more)
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)


def with_ended_first(manager: type) -> type:
    """``manager`` with :class:`EndedFirstMixin` (F23) in front, under its own module and name (the
    activation line, doctor and the tests name the engine's adapter)."""
    return type(manager.__name__, (EndedFirstMixin, manager),
                {"__module__": manager.__module__, "__qualname__": manager.__qualname__,
                 "__doc__": f"{manager.__doc__} With F23's rooms decode ended first."})
