"""core.gate_deadline: the hold clock of decode's metadata gate (F10) and its failure reason."""

import gc
import weakref

import pytest

from sglang_disagg_ext.core.gate_deadline import WAITING_TIMEOUT_ENV, GateClock, GateHold, gate_failure_reason


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "since, timeout_s, now, waited, expired",
    [
        (100.0, 5.0, 100.0, 0.0, False),  # first sighting
        (100.0, 5.0, 104.99, 4.99, False),
        (100.0, 5.0, 105.0, 5.0, True),  # SGLang's rule: elapsed < timeout keeps waiting
        (100.0, 5.0, 250.0, 150.0, True),
        (100.0, 0.0, 100.0, 0.0, True),  # timeout 0: failed when first held, as SGLang's own
        (100.0, 5.0, 99.0, 0.0, False),  # a clock read before the hold began counts as no wait
    ],
)
def test_hold_expiry(since, timeout_s, now, waited, expired):
    hold = GateHold(since=since, timeout_s=timeout_s)
    assert hold.waited(now) == pytest.approx(waited)
    assert hold.expired(now) is expired


@pytest.mark.timeout(10)
def test_clock_starts_once_and_keeps_its_deadline():
    clock = GateClock()
    first = clock.hold("a", now=10.0, timeout_s=3)
    assert first == GateHold(since=10.0, timeout_s=3.0)
    # Later calls (and a changed timeout) do not restart or move the deadline.
    again = clock.hold("a", now=12.0, timeout_s=300)
    assert again == first
    assert not again.expired(12.9) and again.expired(13.0)
    other = clock.hold("b", now=12.0, timeout_s=1)
    assert other.since == 12.0 and len(clock) == 2


@pytest.mark.timeout(10)
def test_release_restarts_the_clock():
    clock = GateClock()
    clock.hold("a", now=1.0, timeout_s=2)
    clock.release("a")
    clock.release("a")  # releasing an unknown key is a no-op
    assert clock.held("a") is None and len(clock) == 0
    assert clock.hold("a", now=50.0, timeout_s=2).since == 50.0


@pytest.mark.timeout(10)
def test_mark_failed_reports_once_and_keeps_the_hold():
    clock = GateClock()
    assert clock.mark_failed("a") is False  # not held: nothing to mark
    clock.hold("a", now=1.0, timeout_s=2)
    assert clock.mark_failed("a") is True
    assert clock.mark_failed("a") is False
    held = clock.held("a")
    assert held == GateHold(since=1.0, timeout_s=2.0, failed=True)
    assert held.expired(3.0)  # still expired at the next poll: no new deadline


@pytest.mark.timeout(10)
def test_weak_store_drops_a_key_nobody_holds():
    class Receiver:
        pass

    clock = GateClock(weakref.WeakKeyDictionary())
    r = Receiver()
    clock.hold(r, now=0.0, timeout_s=1)
    assert len(clock) == 1
    del r
    gc.collect()
    assert len(clock) == 0


@pytest.mark.timeout(10)
def test_clear_forgets_everything():
    clock = GateClock()
    clock.hold("a", now=0.0, timeout_s=1)
    clock.hold("b", now=0.0, timeout_s=1)
    clock.clear()
    assert len(clock) == 0


@pytest.mark.timeout(10)
def test_failure_reason_names_room_index_rows_seconds_and_setting():
    assert WAITING_TIMEOUT_ENV == "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
    assert gate_failure_reason(4242, 3, 8, 300.04, 300) == (
        "decode metadata gate: room 4242's KV transfer reported Success but its metadata never landed: "
        "metadata buffer index 3 of 8 still shows no room after 300.0s "
        "(deadline 300s, SGLANG_DISAGGREGATION_WAITING_TIMEOUT); the request is failed so its KV pages are released"
    )
    assert "metadata buffer index 0 still shows no room after 1.5s (deadline 1.5s," in gate_failure_reason(
        1, 0, None, 1.5, 1.5
    )
