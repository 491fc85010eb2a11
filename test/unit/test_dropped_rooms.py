"""F17's pure table (``core/dropped_rooms.py``): rooms a prefill gave up before decode's metadata arrived."""

import pytest

from sglang_disagg_ext.core.dropped_rooms import (CancelledRooms, DroppedRooms, PendingRooms, cancelled_reason,
                                                  dropped_reason, never_admitted_reason)

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


def test_a_pending_room_collects_its_decode_endpoints_and_expires_after_the_lease():
    clock = Clock()
    pending = PendingRooms(clock=clock)
    pending.note(5, ("10.0.0.2", 7000))
    clock.t += 1.0
    pending.note(5, ("10.0.0.3", 7000))  # a second decode rank of the room: the first note's clock stays
    pending.note(6, ("10.0.0.2", 7000))
    assert pending.expired(2.0) == []
    clock.t += 1.5  # room 5 pending 2.5 s, room 6 1.5 s
    assert pending.expired(2.0) == [(5, 2.5)]
    assert pending.expired(1.0) == [(5, 2.5), (6, 1.5)]  # oldest first
    assert pending.take(5) == {("10.0.0.2", 7000), ("10.0.0.3", 7000)}
    assert pending.take(5) is None and len(pending) == 1


def test_a_room_a_request_opens_is_taken_off_before_its_lease():
    pending = PendingRooms(clock=Clock())
    pending.note(9, ("h", 1))
    assert pending.take(9) == {("h", 1)}  # the request opened it
    assert pending.expired(0.0) == []


def test_the_never_admitted_reason_names_the_room_and_the_wait():
    assert never_admitted_reason(12, 300.04).startswith(
        "prefill never admitted bootstrap_room 12: no request opened it within 300.0s of decode's metadata")


def test_a_room_decode_ended_first_is_taken_once_with_the_time_since():
    clock = Clock()
    rooms = CancelledRooms(clock=clock)
    rooms.note(7, ttl_s=10.0)
    clock.t += 2.5
    assert rooms.take(8, ttl_s=10.0) is None  # never ended by decode
    assert rooms.take(7, ttl_s=10.0) == 2.5
    assert rooms.take(7, ttl_s=10.0) is None and len(rooms) == 0  # a second request in the room is not failed


def test_a_room_decode_ended_longer_ago_than_the_ttl_is_not_failed():
    clock = Clock()
    rooms = CancelledRooms(clock=clock)
    rooms.note(7, ttl_s=10.0)
    clock.t += 10.0
    assert rooms.take(7, ttl_s=10.0) is None
    # Older entries go out when a new one comes in: a stream of ABORTs for rooms never opened stays bounded.
    rooms.note(1, ttl_s=10.0)
    clock.t += 10.0
    rooms.note(2, ttl_s=10.0)
    assert len(rooms) == 1 and rooms.take(2, ttl_s=10.0) == 0.0


def test_cancelled_rooms_keep_at_most_their_capacity_oldest_out_first():
    rooms = CancelledRooms(capacity=2, clock=Clock())
    for room in (1, 2, 3):
        rooms.note(room, ttl_s=10.0)
    assert len(rooms) == 2 and rooms.take(1, ttl_s=10.0) is None and rooms.take(3, ttl_s=10.0) == 0.0
    with pytest.raises(ValueError):
        CancelledRooms(capacity=0)


def test_the_cancelled_reason_names_the_room_and_the_time():
    assert cancelled_reason(1700, 0.25) == (
        "decode ended bootstrap_room 1700 0.2s before this prefill opened it (decode's ABORT arrived first): "
        "prefill fails the request now instead of waiting out its bootstrap timeout")
