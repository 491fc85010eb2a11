"""F16's pure table (``core/room_claims.py``): which live object holds each bootstrap room."""

import gc
import threading

import pytest

from sglang_disagg_ext.core.room_claims import RoomClaims, duplicate_reason

pytestmark = pytest.mark.timeout(30)


class Owner:
    """Stands for SGLang's sender or receiver of one request."""


def test_a_free_room_is_claimed_and_a_second_live_claim_is_refused_with_the_room_and_side():
    claims, a, b = RoomClaims("decode"), Owner(), Owner()
    assert claims.claim(7, a) is None
    reason = claims.claim(7, b)
    assert reason == duplicate_reason(7, "decode")
    assert "bootstrap_room 7 is already in use by a live request on this decode" in reason
    assert claims.holder(7) is a  # the holder is untouched
    assert claims.claim(8, b) is None  # another room is free
    assert len(claims) == 2


def test_the_holder_claiming_again_is_a_no_op():
    claims, a = RoomClaims("prefill"), Owner()
    assert claims.claim(7, a) is None
    assert claims.claim(7, a) is None
    assert claims.holder(7) is a


def test_release_frees_the_room_only_for_its_holder():
    claims, a, b = RoomClaims("prefill"), Owner(), Owner()
    claims.claim(7, a)
    claims.release(7, b)  # a refused duplicate's clear(): not the holder, ignored
    assert claims.holder(7) is a
    claims.release(7, a)
    assert claims.holder(7) is None
    assert claims.claim(7, b) is None  # a room reused after its request ended is served


def test_a_holder_that_is_garbage_collected_gives_its_room_up():
    # A request dropped on a path that never clears its sender must not hold the room for ever.
    claims, b = RoomClaims("decode"), Owner()
    a = Owner()
    claims.claim(7, a)
    del a
    gc.collect()
    assert claims.holder(7) is None and len(claims) == 0
    assert claims.claim(7, b) is None


def test_concurrent_claims_of_one_room_admit_exactly_one():
    claims, owners = RoomClaims("decode"), [Owner() for _ in range(8)]
    results, start = {}, threading.Barrier(len(owners))

    def claim(i):
        start.wait()
        results[i] = claims.claim(99, owners[i])

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(owners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    admitted = [i for i, r in results.items() if r is None]
    assert len(results) == 8 and len(admitted) == 1
    assert claims.holder(99) is owners[admitted[0]]
