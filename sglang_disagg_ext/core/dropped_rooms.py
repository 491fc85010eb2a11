"""Rooms a prefill gave up before decode's metadata arrived, and rooms it never admitted (F17).

Pure: no SGLang, no torch. A prefill request waits in Bootstrapping for
decode's page lists; at SGLang's bootstrap timeout (or an abort) prefill ends it
Failed and tells decode nothing, because it has no decode address for the room
yet. When that decode's metadata arrives later (its pre-allocation waited for
KV memory, say), SGLang's prefill bootstrap thread stores it for a room no
request will ever serve, and decode holds the request's KV pages until its own
waiting timeout (300 s by default). This table remembers such rooms for a while,
so that the late metadata can be answered with Failed at once.

A room is *dropped* when prefill fails it while still waiting for decode, and
*reopened* when a new request opens the same room (bootstrap rooms are the
client's to pick; reuse after the first request ended is legitimate). Entries
expire after ``ttl_s`` and the table holds at most ``capacity`` rooms (oldest
first out), so a stream of abandoned requests cannot grow it without bound.

The reverse: decode ends a room (its ABORT: a refusal, its waiting timeout, an abort) before
the request reaches this prefill's scheduler. SGLang's ABORT handler ignores a room it has no
status for, and the request that opens the room later waits out the bootstrap timeout for
metadata no decode will send. :class:`CancelledRooms` remembers such rooms (for SGLang's waiting
plus bootstrap timeouts, as 0.5.23's own ``DeferredBootstrap`` keeps a cancellation that beats
the sender, in its ``prefill_complete`` mode only) so that the request fails when it opens the room.

The other orphan: decode's metadata for a room prefill never admitted (the
client's or router's request to prefill was refused before it reached the
scheduler, or never sent). Stock stores it and marks the room WaitingForInput
for ever (prefill's tables keep it), and decode waits out its waiting timeout.
:class:`PendingRooms` holds such rooms with the decode ranks that wrote them,
until a request opens the room or a lease runs out.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple


def never_admitted_reason(room: int, waited_s: float) -> str:
    """What decode is told for a room prefill never admitted within the lease."""
    return (f"prefill never admitted bootstrap_room {room}: no request opened it within {waited_s:.1f}s of decode's "
            f"metadata (SGLang's bootstrap timeout); decode releases the request instead of waiting out its "
            f"waiting timeout")


def dropped_reason(room: int, why: Optional[str]) -> str:
    """What decode is told (and logs) for a room prefill dropped: names the room and prefill's reason."""
    cause = why or "it ended Failed while waiting for decode"
    return (f"prefill had already dropped bootstrap_room {room} before decode's metadata for it arrived "
            f"({cause}); decode releases the request now instead of holding its KV pages until its waiting timeout")


class DroppedRooms:
    """Recently dropped rooms of one prefill manager. Thread-safe: the scheduler thread drops
    and reopens rooms, the bootstrap thread asks."""

    def __init__(self, ttl_s: float = 3600.0, capacity: int = 65536,
                 clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or capacity <= 0:
            raise ValueError(f"ttl_s and capacity must be > 0, got ttl_s={ttl_s}, capacity={capacity}")
        self.ttl_s = float(ttl_s)
        self.capacity = int(capacity)
        self._clock = clock
        self._lock = threading.Lock()
        # room -> (time dropped, prefill's reason), oldest first
        self._rooms: "collections.OrderedDict[int, Tuple[float, Optional[str]]]" = collections.OrderedDict()

    def drop(self, room: int, why: Optional[str]) -> None:
        now = self._clock()
        with self._lock:
            self._rooms.pop(room, None)
            self._rooms[room] = (now, why)
            self._expire(now)
            while len(self._rooms) > self.capacity:
                self._rooms.popitem(last=False)

    def reopen(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def refusal(self, room: int) -> Optional[str]:
        """The reason to refuse decode's metadata for ``room``, or None (not dropped, or expired).

        The entry stays until it expires or the room is reopened: each decode rank of the
        room sends its own metadata and each must be told."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            entry = self._rooms.get(room)
        return None if entry is None else dropped_reason(room, entry[1])

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._rooms)

    def _expire(self, now: float) -> None:
        while self._rooms:
            room, (t, _) = next(iter(self._rooms.items()))
            if now - t < self.ttl_s:
                return
            self._rooms.popitem(last=False)


def cancelled_reason(room: int, waited_s: float) -> str:
    """What prefill records for a request that opens a room decode had already ended."""
    return (f"decode ended bootstrap_room {room} {waited_s:.1f}s before this prefill opened it (decode's ABORT "
            f"arrived first): prefill fails the request now instead of waiting out its bootstrap timeout")


class CancelledRooms:
    """Rooms decode ended (its ABORT) before any request opened them on this prefill, until a request
    opens one (which then fails at once) or ``ttl_s`` passes. Not thread-safe: the caller serialises
    ``note`` (bootstrap thread) against ``take`` (a request opening the room). At most ``capacity``
    rooms, oldest out first, so a stream of ABORTs for rooms never opened cannot grow it without bound."""

    def __init__(self, capacity: int = 65536, clock: Callable[[], float] = time.monotonic):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = int(capacity)
        self._clock = clock
        self._rooms: "collections.OrderedDict[int, float]" = collections.OrderedDict()  # room -> time noted

    def note(self, room: int, ttl_s: float) -> None:
        now = self._clock()
        self._rooms.pop(room, None)
        self._rooms[room] = now
        while self._rooms and (len(self._rooms) > self.capacity or now - next(iter(self._rooms.values())) >= ttl_s):
            self._rooms.popitem(last=False)

    def take(self, room: int, ttl_s: float) -> Optional[float]:
        """Seconds since decode ended ``room``, taking it off the table; None when it was not
        noted or was noted ``ttl_s`` or longer ago."""
        noted = self._rooms.pop(room, None)
        if noted is None:
            return None
        waited = self._clock() - noted
        return waited if waited < ttl_s else None

    def __len__(self) -> int:
        return len(self._rooms)


class PendingRooms:
    """Rooms decode wrote metadata for before any request opened them on this prefill, with the
    decode endpoints to tell. Not thread-safe: the caller serialises ``note`` against ``take``
    (a request opening the room), so that a room is never released under a request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._rooms: Dict[int, Tuple[float, Set[Tuple[str, int]]]] = {}

    def note(self, room: int, target: Tuple[str, int]) -> None:
        since, targets = self._rooms.setdefault(room, (self._clock(), set()))
        targets.add(target)

    def take(self, room: int) -> Optional[Set[Tuple[str, int]]]:
        """The room's decode endpoints, taking it off the table (None: not pending)."""
        entry = self._rooms.pop(room, None)
        return None if entry is None else entry[1]

    def expired(self, lease_s: float) -> List[Tuple[int, float]]:
        """(room, seconds pending) of every room pending ``lease_s`` or longer, oldest first."""
        now = self._clock()
        return sorted(((room, now - since) for room, (since, _) in self._rooms.items() if now - since >= lease_s),
                      key=lambda x: -x[1])

    def __len__(self) -> int:
        return len(self._rooms)
