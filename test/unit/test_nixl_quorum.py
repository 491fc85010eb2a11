"""core.nixl_quorum.RoomQuorum: a decode room's aux and failure notifications, by hand."""

import pytest

from sglang_disagg_ext.core.nixl_quorum import AUX, FAIL, RoomQuorum

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_aux_released_once_every_expected_rank_sent_one():
    q = RoomQuorum()
    assert q.offer_aux(7, "p0", b"7_aux", required=2) == []
    assert q.offer_aux(7, "p0", b"7_aux", required=2) == []  # the same rank twice is still one
    assert q.offer_aux(7, "p1", b"7_aux", required=2) == [(AUX, "p0", b"7_aux"), (AUX, "p0", b"7_aux"),
                                                         (AUX, "p1", b"7_aux")]
    assert q.pending() == 0
    assert q.offer_aux(7, "p2", b"7_aux", required=2) == []  # late: dropped


def test_one_rank_room_passes_at_once():
    q = RoomQuorum()
    assert q.offer_aux(1, "p0", b"1_aux_nokv_0", required=1) == [(AUX, "p0", b"1_aux_nokv_0")]
    assert q.offer_failure(2, "p0", "n2", required=1) == [(FAIL, "p0", "n2")]
    assert q.offer_aux(1, "p0", b"1_aux", required=0) == []  # closed; required < 1 reads as 1


def test_failure_waits_for_the_other_ranks_then_drops_held_aux():
    q = RoomQuorum()
    assert q.offer_aux(5, "p0", b"5_aux", required=2) == []
    # Rank 1 failed: rank 0 already concluded (its aux landed), so the failure goes now,
    # and rank 0's aux is never released.
    assert q.offer_failure(5, "p1", "n", required=2) == [(FAIL, "p1", "n")]
    assert q.offer_aux(5, "p1", b"5_aux", required=2) == []
    assert q.offer_failure(5, "p0", "again", required=2) == []


def test_failure_held_until_every_rank_concluded():
    q = RoomQuorum()
    assert q.offer_failure(9, "p1", "first", required=3) == []
    assert q.offer_failure(9, "p2", "second", required=3) == []
    assert q.offer_aux(9, "p0", b"9_aux", required=3) == [(FAIL, "p1", "first")]  # the first notice


def test_held_failure_released_after_grace():
    clock = Clock()
    q = RoomQuorum(grace_s=5.0, clock=clock)
    assert q.offer_failure(3, "p1", "n", required=2) == []
    clock.t += 4.999
    assert q.expired() == []
    clock.t += 0.001
    assert q.expired() == [(FAIL, "p1", "n")]
    assert q.expired() == [] and q.pending() == 0
    assert q.offer_aux(3, "p0", b"3_aux", required=2) == []


def test_failure_after_aux_release_passes_at_once():
    # A rank whose aux landed can still see one of its KV handles fail.
    q = RoomQuorum()
    q.offer_aux(4, "p0", b"4_aux", required=1)
    assert q.offer_failure(4, "p0", "kv ERR", required=1) == [(FAIL, "p0", "kv ERR")]
    assert q.offer_failure(4, "p0", "again", required=1) == []


def test_forget_drops_what_is_held():
    q = RoomQuorum()
    q.offer_aux(8, "p0", b"8_aux", required=2)
    q.forget(8)
    assert q.pending() == 0
    assert q.offer_aux(8, "p1", b"8_aux", required=2) == []


def test_negative_grace_rejected():
    with pytest.raises(ValueError):
        RoomQuorum(grace_s=-1)
