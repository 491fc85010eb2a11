"""F17 on the real Mooncake engine (TCP, 127.0.0.1): decode's metadata for a room prefill dropped or never admitted.

Three requests, one at a time (scenarios and verdicts: ``test/support/orphan_rooms.py``). Request 0
is served as usual. For request 1 decode waits ``DELAY_S`` after bootstrapping before it sends its
metadata (a decode whose pre-allocation waited for KV memory), longer than prefill's bootstrap
timeout (``BOOTSTRAP_S``): prefill
ends request 1 Failed at that timeout, with no decode address to tell, and decode's
metadata arrives after. Request 2 (``-ext`` run only) is served after it.

Stock (every release; run by hand on 0.5.11, 0.5.16, 0.5.20, 0.5.22, 0.5.23): prefill's bootstrap thread stores the
late metadata for a room no request will serve, and decode holds request 1's pages in
WaitingForInput: still there at the harness bound (``REQUEST_S`` after its metadata), with
SGLang's waiting timeout at ``WAITING_S`` (300 s by default in SGLang).
``-ext``: prefill answers the late metadata with Failed at once; decode ends request 1 Failed
within ``REFUSED_WITHIN_S`` of sending it, with prefill's reason naming the room and the
bootstrap timeout; nothing is written to its pages; requests 0 and 2 byte-verified; no
thread died; ``requests_refused_total{fix="F17"}`` is 1 on prefill.

The never-admitted room: the same three requests, but prefill makes no sender at all for
request 1 (its request to prefill was refused before the scheduler) and decode sends its
metadata at once. Stock: prefill stores it and marks the room WaitingForInput for ever; decode
still waits at the bound. ``-ext``: after a lease of SGLang's bootstrap timeout with no request
opening the room, prefill drops its entries and answers decode Failed with the reason (within
the lease plus the sweeper's second and some slack).
"""

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from support import orphan_rooms as O

POLICY = releases.current_policy()
# The bug is live on every release; the -ext adapter covers 0.5.22+ ("live, not covered" before):
# the stock test runs wherever the bug is live (CI runs this file on the legs that prove F17).
BUG_LIVE = POLICY.fixes.get("F17") in (releases.FixStatus.LIVE, releases.FixStatus.UNCOVERED)
pytestmark = [
    pytest.mark.engine,
    required_part("Mooncake", engine_importable("mooncake"), "mooncake.engine does not import"),
]
ROOM_BASE = 1700


@pytest.mark.timeout(O.RUN_BOUND_S)
@pytest.mark.skipif(not BUG_LIVE, reason=f"F17's bug is not live on SGLang {POLICY.version}")
def test_stock_decode_holds_the_dropped_room_past_the_bound():
    O.assert_stock_holds_the_dropped_room(O.run(O.scenario(ROOM_BASE, follow_up=False), "mooncake"))


@pytest.mark.timeout(O.RUN_BOUND_S)
@pytest.mark.skipif(not POLICY.is_live("F17"), reason=f"F17 is not covered on SGLang {POLICY.version} (0.5.22+)")
def test_ext_refuses_the_late_metadata_at_once_and_serves_on():
    O.assert_ext_refuses_the_late_metadata(O.run(O.scenario(ROOM_BASE, follow_up=True), "mooncake-ext"), "F17")


@pytest.mark.timeout(O.RUN_BOUND_S)
@pytest.mark.skipif(not BUG_LIVE, reason=f"F17's bug is not live on SGLang {POLICY.version}")
def test_stock_decode_waits_for_a_room_prefill_never_admitted():
    O.assert_stock_waits_for_the_room_never_admitted(
        O.run(O.scenario(ROOM_BASE, follow_up=False, never_admitted=True), "mooncake"))


@pytest.mark.timeout(O.RUN_BOUND_S)
@pytest.mark.skipif(not POLICY.is_live("F17"), reason=f"F17 is not covered on SGLang {POLICY.version} (0.5.22+)")
def test_ext_releases_a_room_never_admitted_after_the_lease_and_serves_on():
    O.assert_ext_releases_the_room_never_admitted(
        O.run(O.scenario(ROOM_BASE, follow_up=True, never_admitted=True), "mooncake-ext"), "F17")


@pytest.mark.timeout(O.RUN_BOUND_S)
@pytest.mark.skipif(not BUG_LIVE, reason=f"F17's bug is not live on SGLang {POLICY.version}")
def test_stock_prefill_waits_out_its_bootstrap_timeout_for_a_room_decode_ended():
    O.assert_stock_waits_for_the_room_decode_ended(O.run(O.ended_first_scenario(ROOM_BASE), "mooncake"))


@pytest.mark.timeout(O.RUN_BOUND_S)
@pytest.mark.skipif(not POLICY.is_live("F17"), reason=f"F17 is not covered on SGLang {POLICY.version} (0.5.22+)")
def test_ext_prefill_fails_a_room_decode_ended_when_it_opens_it():
    O.assert_ext_fails_it_on_opening(O.run(O.ended_first_scenario(ROOM_BASE), "mooncake-ext"), "F17")
