"""Decode side of NIXL (F4's classes): a room concludes once every prefill rank it expects has. No SGLang import.

Up to 0.5.12.x stock NIXL decode completes a room on its *first* ``<room>_aux``
notification (0.5.10.post1 nixl/conn.py:839-840, 0.5.11 :1022-1023, 0.5.12.post1
:1670), though every prefill rank feeding that decode rank writes the same aux row
and sends one. With prefill TP 2 -> decode TP 1, rank 0's row can complete the room
on decode while rank 1's post of it fails and rank 1 fails the room on prefill: a
split (the soak measured 12 of 512 on 0.5.12.post1). The other way round, a failure
notice from one rank ends the room on decode while another rank's writes into its
pages are still in flight, and decode hands those pages to the next request.

``RoomQuorum`` sits where notifications enter decode (``ExtNixlAgent.get_new_notifs``)
and releases them by room:

* aux notifications are held until ``required`` distinct prefill agents (SGLang's
  ``required_prefill_response_num`` of the room) have sent one, then all released
  together, so stock's ``received_aux`` means every rank's row landed;
* a failure notice is held until every expected rank has concluded (sent its aux or
  its own failure notice) or ``grace_s`` passed since the first notice, then released
  once; the room's held aux notifications are dropped with it.

A room whose ranks never all conclude and that got no failure notice is not ended
here: SGLang's waiting timeout ends it, as before. Once a room's aux notifications
were released, a later failure notice for it passes at once (a rank whose aux landed
can still see a KV handle fail; stock then waits for that chunk's notification) and
later aux notifications are dropped; once a failure was released, everything later
for the room is dropped (``closed``: the last ``CLOSED_KEEP`` rooms).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

# As long as SGLang 0.5.23 lets a failed NIXL batch's sibling handles settle
# (NIXL_ERR_SETTLE_TIMEOUT_S, 0.5.23 nixl/conn.py:182).
DEFAULT_GRACE_S = 5.0
CLOSED_KEEP = 65536

AUX = "aux"
FAIL = "fail"


class _Room:
    __slots__ = ("aux_peers", "failed_peers", "held", "failure", "failed_at")

    def __init__(self):
        self.aux_peers: Set[str] = set()
        self.failed_peers: Set[str] = set()
        self.held: List[Tuple[str, Any]] = []  # (peer, aux message) in arrival order
        self.failure: Optional[Tuple[str, Any]] = None  # (peer, notice) of the first failure
        self.failed_at = 0.0


Release = Tuple[str, str, Any]  # (AUX, peer, message) or (FAIL, peer, notice)


class RoomQuorum:
    """Per-room aux and failure notifications, released when every expected prefill rank concluded."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, clock: Callable[[], float] = time.monotonic):
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = float(grace_s)
        self._clock = clock
        self._rooms: Dict[int, _Room] = {}
        self._closed: "collections.OrderedDict[int, str]" = collections.OrderedDict()  # room -> AUX or FAIL
        self._lock = threading.Lock()

    def pending(self) -> int:
        """Rooms with something held."""
        with self._lock:
            return len(self._rooms)

    def offer_aux(self, room: int, peer: str, message: Any, required: int) -> List[Release]:
        """An aux notification of ``room`` from prefill agent ``peer``; what to release now."""
        with self._lock:
            if room in self._closed:
                return []
            st = self._rooms.setdefault(room, _Room())
            st.aux_peers.add(peer)
            st.held.append((peer, message))
            return self._settle(room, st, required)

    def offer_failure(self, room: int, peer: str, notice: Any, required: int) -> List[Release]:
        """A failure notice of ``room`` from prefill agent ``peer``; what to release now."""
        with self._lock:
            closed = self._closed.get(room)
            if closed == FAIL:
                return []
            if closed == AUX:
                self._close(room, FAIL)
                return [(FAIL, peer, notice)]
            st = self._rooms.setdefault(room, _Room())
            st.failed_peers.add(peer)
            if st.failure is None:
                st.failure, st.failed_at = (peer, notice), self._clock()
            return self._settle(room, st, required)

    def expired(self) -> List[Release]:
        """Failure notices held for ``grace_s`` or longer, released now."""
        now = self._clock()
        out: List[Release] = []
        with self._lock:
            for room in [r for r, st in self._rooms.items() if st.failure and now - st.failed_at >= self.grace_s]:
                st = self._rooms.pop(room)
                self._close(room, FAIL)
                out.append((FAIL, st.failure[0], st.failure[1]))
        return out

    def forget(self, room: int) -> None:
        """``room`` ended some other way (SGLang's timeout, an abort): drop what is held."""
        with self._lock:
            self._rooms.pop(room, None)
            self._close(room, FAIL)

    # -- internals (lock held) ---------------------------------------------------------
    def _settle(self, room: int, st: _Room, required: int) -> List[Release]:
        required = max(1, int(required))
        if st.failure is not None:
            if len(st.aux_peers | st.failed_peers) < required:
                return []
            del self._rooms[room]
            self._close(room, FAIL)
            return [(FAIL, st.failure[0], st.failure[1])]
        if len(st.aux_peers) < required:
            return []
        del self._rooms[room]
        self._close(room, AUX)
        return [(AUX, peer, msg) for peer, msg in st.held]

    def _close(self, room: int, how: str) -> None:
        self._closed[room] = how
        self._closed.move_to_end(room)
        while len(self._closed) > CLOSED_KEEP:
            self._closed.popitem(last=False)
