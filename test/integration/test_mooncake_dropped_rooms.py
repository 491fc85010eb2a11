"""F17 on the real Mooncake engine (TCP, 127.0.0.1): decode's metadata for a room prefill dropped or never admitted.

Three requests, one at a time. Request 0 is served as usual. For request 1 decode waits
``DELAY_S`` after bootstrapping before it sends its metadata (a decode whose pre-allocation
waited for KV memory), longer than prefill's bootstrap timeout (``BOOTSTRAP_S``): prefill
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
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, Timeouts
from support import ended_first, plugin_metrics

POLICY = releases.current_policy()
# The bug is live on every release; the -ext adapter covers 0.5.22+ ("live, not covered" before):
# the stock test runs wherever the bug is live (CI runs this file on the legs that prove F17).
BUG_LIVE = POLICY.fixes.get("F17") in (releases.FixStatus.LIVE, releases.FixStatus.UNCOVERED)
pytestmark = [
    pytest.mark.engine,
    required_part("Mooncake", engine_importable("mooncake"), "mooncake.engine does not import"),
]
BOOTSTRAP_S = 6.0  # prefill's bootstrap timeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)
DELAY_S = 8.5  # decode's wait before sending request 1's metadata: past prefill's bootstrap timeout
WAITING_S = 120.0  # decode's waiting timeout: far past the bound, as SGLang's default 300 s is
REQUEST_S = 10.0  # the harness bound per request and side (decode's counts from its metadata)
REFUSED_WITHIN_S = 3.0
LEASE_SLACK_S = 3.0  # the sweeper's one-second tick, and two cores shared by five processes
RUN_BOUND_S = 240
ROOM_BASE = 1700


def _scenario(follow_up: bool, never_admitted: bool = False) -> Scenario:
    orphan = (dict(prefill_admits=False) if never_admitted else dict(decode_metadata_delay_s=DELAY_S))
    reqs = [RequestSpec(src_kv_pages=[1, 2], dst_kv_pages=[3, 4], aux_index=0),
            RequestSpec(src_kv_pages=[5, 6], dst_kv_pages=[9, 10], aux_index=1, **orphan)]
    if follow_up:
        reqs.append(RequestSpec(src_kv_pages=[7, 8], dst_kv_pages=[11, 12], aux_index=2))
    return _with(reqs, "decode metadata for a room prefill never admitted" if never_admitted else
                 "decode metadata after prefill dropped the room")


def _with(reqs, name: str) -> Scenario:
    return Scenario(
        name=name,
        requests=reqs,
        kv=KVPoolSpec(num_pages=14),
        room_base=ROOM_BASE,
        timeouts=Timeouts(request_s=REQUEST_S, sglang_waiting_s=WAITING_S, sglang_bootstrap_s=BOOTSTRAP_S),
    )


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(not BUG_LIVE, reason=f"F17's bug is not live on SGLang {POLICY.version}")
def test_stock_decode_holds_the_dropped_room_past_the_bound():
    stock = run_scenario(_scenario(follow_up=False), "mooncake")
    assert not stock.error, stock.describe()
    first, dropped = stock.requests
    assert first.ok, stock.describe()
    # Prefill gave up at its bootstrap timeout and told decode nothing: decode, which sent
    # its metadata after that, still waits for the room at the bound.
    assert dropped.prefill_status == "Failed", stock.describe()
    assert "timed out" in (dropped.prefill_failure_reason or ""), stock.describe()
    assert dropped.decode_status == "WaitingForInput", stock.describe()
    # (the bound counts from before decode's delay; its metadata went out a moment after that)
    assert dropped.decode_seconds is not None and dropped.decode_seconds >= REQUEST_S - 1.0, stock.describe()
    print(f"stock: decode still {dropped.decode_status} {dropped.decode_seconds} s after its metadata "
          f"for room {dropped.room}, which prefill had failed: {dropped.prefill_failure_reason}")


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(not POLICY.is_live("F17"), reason=f"F17 is not covered on SGLang {POLICY.version} (0.5.22+)")
def test_ext_refuses_the_late_metadata_at_once_and_serves_on():
    ext = run_scenario(_scenario(follow_up=True), "mooncake-ext")
    assert not ext.error, ext.describe()
    first, dropped, after = ext.requests
    assert first.ok and after.ok, ext.describe()
    assert (dropped.prefill_status, dropped.decode_status) == ("Failed", "Failed"), ext.describe()
    assert dropped.decode_seconds is not None and dropped.decode_seconds < REFUSED_WITHIN_S, ext.describe()
    reason = dropped.decode_failure_reason or ""
    assert f"prefill had already dropped bootstrap_room {dropped.room}" in reason, ext.describe()
    assert "timed out" in reason, ext.describe()  # prefill's own reason travels with it
    # Nothing was written for it: decode's check after it finds each of its own pages (KV 9, 10,
    # aux row 1) "the sentinel (never written)" where its bytes would be, and nothing else wrong;
    # request 2's check finds request 0's pages still holding request 0's bytes.
    assert dropped.mismatches and all("the sentinel (never written)" in m for m in dropped.mismatches), \
        ext.describe()
    assert ext.thread_errors == {"prefill": [], "decode": []}, ext.describe()
    assert plugin_metrics.value(ext.plugin_metrics["prefill"], "sglang_disagg_ext_requests_refused_total",
                                fix="F17", reason="room dropped by prefill") == 1.0, ext.describe()
    print(f"-ext: room {dropped.room} Failed on decode {dropped.decode_seconds} s after its metadata: {reason}; "
          f"{len(dropped.mismatches)} of its pages checked, each the sentinel")



@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(not BUG_LIVE, reason=f"F17's bug is not live on SGLang {POLICY.version}")
def test_stock_decode_waits_for_a_room_prefill_never_admitted():
    stock = run_scenario(_scenario(follow_up=False, never_admitted=True), "mooncake")
    assert not stock.error, stock.describe()
    first, orphan = stock.requests
    assert first.ok, stock.describe()
    assert orphan.prefill_status == "NotAdmitted", stock.describe()
    assert orphan.decode_status == "WaitingForInput", stock.describe()
    assert orphan.decode_seconds is not None and orphan.decode_seconds >= REQUEST_S - 1.0, stock.describe()
    print(f"stock: decode still {orphan.decode_status} {orphan.decode_seconds} s after its metadata for room "
          f"{orphan.room}, which no prefill request holds")


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(not POLICY.is_live("F17"), reason=f"F17 is not covered on SGLang {POLICY.version} (0.5.22+)")
def test_ext_releases_a_room_never_admitted_after_the_lease_and_serves_on():
    ext = run_scenario(_scenario(follow_up=True, never_admitted=True), "mooncake-ext")
    assert not ext.error, ext.describe()
    first, orphan, after = ext.requests
    assert first.ok and after.ok, ext.describe()
    assert (orphan.prefill_status, orphan.decode_status) == ("NotAdmitted", "Failed"), ext.describe()
    assert orphan.decode_seconds is not None, ext.describe()
    assert BOOTSTRAP_S - 0.5 <= orphan.decode_seconds < BOOTSTRAP_S + LEASE_SLACK_S, ext.describe()
    reason = orphan.decode_failure_reason or ""
    assert f"prefill never admitted bootstrap_room {orphan.room}" in reason, ext.describe()
    assert orphan.mismatches and all("the sentinel (never written)" in m for m in orphan.mismatches), \
        ext.describe()
    assert ext.thread_errors == {"prefill": [], "decode": []}, ext.describe()
    assert plugin_metrics.value(ext.plugin_metrics["prefill"], "sglang_disagg_ext_requests_refused_total",
                                fix="F17", reason="room never admitted by prefill") == 1.0, ext.describe()
    print(f"-ext: room {orphan.room} Failed on decode {orphan.decode_seconds} s after its metadata: {reason}")


def _ended_first_scenario() -> Scenario:
    return _with(ended_first.requests(), "decode ended the room before prefill opened it")


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(not BUG_LIVE, reason=f"F17's bug is not live on SGLang {POLICY.version}")
def test_stock_prefill_waits_out_its_bootstrap_timeout_for_a_room_decode_ended():
    stock = run_scenario(_ended_first_scenario(), "mooncake")
    assert not stock.error, stock.describe()
    ended, after = stock.requests
    assert after.ok, stock.describe()
    assert ended.decode_status == "Failed", stock.describe()
    # Stock's ABORT handler ignored the room (no status yet): the request that opened it waited for
    # decode's metadata until the bootstrap timeout.
    assert ended.prefill_status == "Failed" and "timed out" in (ended.prefill_failure_reason or ""), stock.describe()
    assert ended.prefill_seconds is not None and ended.prefill_seconds >= BOOTSTRAP_S - 0.5, stock.describe()
    print(f"stock: prefill held room {ended.room}, which decode had ended, for {ended.prefill_seconds} s: "
          f"{ended.prefill_failure_reason}")


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(not POLICY.is_live("F17"), reason=f"F17 is not covered on SGLang {POLICY.version} (0.5.22+)")
def test_ext_prefill_fails_a_room_decode_ended_when_it_opens_it():
    ext = run_scenario(_ended_first_scenario(), "mooncake-ext")
    ended_first.assert_ext_fails_it_on_opening(ext, "F17", REFUSED_WITHIN_S)
