"""F24 for ``nixl-ext`` (0.5.20+): ``backends.common.dropped_rooms`` on NIXL's per-room message.

Decode's per-room metadata message on NIXL is the guard frame, then (room, endpoint, dst_port,
agent name, KV indices, ...): 0.5.23 nixl/conn.py ``TransferInfo.from_zmq`` (:303-330), read by the
bootstrap loop after its guard check (:3385-3392). Decode hears the Failed status this sends through
its status listener (``parse_kv_status_message`` / ``apply_prefill_status``, 0.5.20+; before, a NIXL
decode has no message for a room prefill failed: F24 is "live, not covered" there). The reverse orphan
(``backends.common.ended_first``) keeps its own id here, F23 (0.5.16+).
"""

from __future__ import annotations

import functools

from sglang_disagg_ext.backends.common.dropped_rooms import DroppedRoomsMixin, room_and_endpoint


@functools.lru_cache(maxsize=None)  # read once, not on every bootstrap message
def _guard() -> bytes:
    from sglang.srt.disaggregation.nixl import conn

    return conn.GUARD


class NixlDroppedRoomsMixin(DroppedRoomsMixin):
    """F24 (and F23): see the module docstring."""

    DROPPED_ROOMS_FIX = "F24"
    ENDED_FIRST_FIX = "F23"

    def _room_and_endpoint(self, msg):
        if not msg or msg[0] != _guard():
            return None
        return room_and_endpoint(msg[1:], 5)  # the frames after the guard, up to the KV indices


def with_dropped_rooms(manager: type) -> type:
    """``manager`` with :class:`NixlDroppedRoomsMixin` in front, under its own module and name (the
    activation line, doctor and the tests name the engine's adapter)."""
    return type(manager.__name__, (NixlDroppedRoomsMixin, manager),
                {"__module__": manager.__module__, "__qualname__": manager.__qualname__,
                 "__doc__": f"{manager.__doc__} With F23/F24's rooms prefill dropped, never admitted or decode ended."})
