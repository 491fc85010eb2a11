"""F17's pure table (``core/dropped_rooms.py``): rooms a prefill gave up before decode's metadata arrived."""

import pytest

from sglang_disagg_ext.core.dropped_rooms import DroppedRooms, dropped_reason

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_dropped_room_is_refused_with_the_room_and_prefills_reason_until_reopened():
    rooms = DroppedRooms(clock=Clock())
    assert rooms.refusal(7) is None
    rooms.drop(7, "Request 7 timed out after 300.0s in KVPoll.Bootstrapping")
    reason = rooms.refusal(7)
    assert reason.startswith("prefill had already dropped bootstrap_room 7 before decode's metadata for it arrived "
                             "(Request 7 timed out after 300.0s in KVPoll.Bootstrapping)")
    assert rooms.refusal(7) == reason  # every decode rank of the room is told: the entry stays
    assert rooms.refusal(8) is None
    rooms.reopen(7)  # a new request opened the room: its metadata is served
    assert rooms.refusal(7) is None and len(rooms) == 0


def test_without_a_recorded_reason_the_refusal_still_says_why():
    rooms = DroppedRooms(clock=Clock())
    rooms.drop(3, None)
    assert "(it ended Failed while waiting for decode)" in rooms.refusal(3)
    assert dropped_reason(3, None) == rooms.refusal(3)


def test_entries_expire_after_the_ttl():
    clock = Clock()
    rooms = DroppedRooms(ttl_s=10.0, clock=clock)
    rooms.drop(1, "a")
    clock.t += 5.0
    rooms.drop(2, "b")
    clock.t += 5.0  # room 1 is 10 s old: gone; room 2 is 5 s old
    assert rooms.refusal(1) is None and rooms.refusal(2) is not None and len(rooms) == 1
    clock.t += 5.0
    assert len(rooms) == 0


def test_capacity_drops_the_oldest_first_and_a_second_drop_renews_a_room():
    rooms = DroppedRooms(capacity=2, clock=Clock())
    rooms.drop(1, "a")
    rooms.drop(2, "b")
    rooms.drop(1, "a again")  # room 1 is now the newest
    rooms.drop(3, "c")  # over capacity: room 2, the oldest, goes
    assert [r for r in (1, 2, 3) if rooms.refusal(r)] == [1, 3]
    assert "(a again)" in rooms.refusal(1)


@pytest.mark.parametrize("ttl_s, capacity", [(0, 1), (-1.0, 1), (1.0, 0)])
def test_bad_bounds_are_refused(ttl_s, capacity):
    with pytest.raises(ValueError, match="ttl_s and capacity must be > 0"):
        DroppedRooms(ttl_s=ttl_s, capacity=capacity)
