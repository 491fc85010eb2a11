"""Which live request holds each bootstrap room on one side of a PD pair (F16).

Pure: no SGLang, no torch. SGLang keys every per-request table of a transfer
manager by ``bootstrap_room`` alone (status, failure reasons, decode's page
lists on prefill), and nothing refuses a second live request that names a room
already in use: a client may post its own ``bootstrap_room`` to both servers
(upstream sgl-project/sglang#40125). The second request then shares the first's
status and overwrites its page lists, and once either is cleared the other's
next poll raises ``KeyError`` on the scheduler thread.

A room is *claimed* by the sender or receiver SGLang makes for a request and
*released* by that object's ``clear()``, or when the object is garbage
collected (a request dropped on a path that never clears it must not hold its
room for ever). A claim on a room another live object holds is refused; the
holder is untouched.
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, Optional


def duplicate_reason(room: int, side: str) -> str:
    """The refusal reason (logged, returned to the client): names the room and the side."""
    return (f"bootstrap_room {room} is already in use by a live request on this {side}; this request is "
            f"refused and the one holding the room is untouched (bootstrap_room must be unique per live request)")


class RoomClaims:
    """Live holders of bootstrap rooms, one table per transfer manager.

    Thread-safe: SGLang makes and clears senders and receivers on its scheduler
    thread, but the garbage collector may release a claim from any thread.
    """

    def __init__(self, side: str):
        self.side = side
        self._lock = threading.RLock()  # a weakref callback may run inside claim()
        self._holders: Dict[int, weakref.ref] = {}

    def claim(self, room: int, owner: object) -> Optional[str]:
        """None: ``owner`` now holds ``room``. Else the reason it is refused (another live
        owner holds it). Claiming a room one already holds is a no-op."""
        with self._lock:
            ref = self._holders.get(room)
            holder = ref() if ref is not None else None
            if holder is not None and holder is not owner:
                return duplicate_reason(room, self.side)
            if holder is None:
                self._holders[room] = weakref.ref(owner, self._forget(room))
            return None

    def release(self, room: int, owner: object) -> None:
        """``owner`` no longer holds ``room`` (a release by any other object is ignored)."""
        with self._lock:
            ref = self._holders.get(room)
            if ref is not None and ref() is owner:
                del self._holders[room]

    def holder(self, room: int) -> Optional[object]:
        with self._lock:
            ref = self._holders.get(room)
            return ref() if ref is not None else None

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for ref in self._holders.values() if ref() is not None)

    def _forget(self, room: int):
        def forget(ref) -> None:
            with self._lock:
                if self._holders.get(room) is ref:
                    del self._holders[room]
        return forget
