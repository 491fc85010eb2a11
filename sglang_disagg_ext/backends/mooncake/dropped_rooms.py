"""F17 for ``mooncake-ext`` (0.5.22+): ``backends.common.dropped_rooms`` on Mooncake's per-room message.

Decode's per-room metadata message on Mooncake is (room, endpoint, port, session, ...,
``required_dst_info_num`` in frame 7): 0.5.23 mooncake/conn.py ``TransferInfo.from_zmq``. The
reverse orphan (``backends.common.ended_first``) is counted under F17 here too.
"""

from __future__ import annotations

from sglang_disagg_ext.backends.common.dropped_rooms import DroppedRoomsMixin, room_and_endpoint


class MooncakeDroppedRoomsMixin(DroppedRoomsMixin):
    """F17: see the module docstring."""

    DROPPED_ROOMS_FIX = ENDED_FIRST_FIX = "F17"

    def _room_and_endpoint(self, msg):
        return room_and_endpoint(msg, 8)
