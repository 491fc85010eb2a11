"""Orphan rooms on prefill, shared by F17's Mooncake tests and F23/F24's NIXL tests: the scenarios,
and what stock and ``-ext`` must show for them (the tests' docstrings tell each case's story).

Three requests, one at a time. Request 0 is served as usual. Request 1 is the orphan: decode sends
its metadata ``DELAY_S`` after bootstrapping, past prefill's bootstrap timeout (``BOOTSTRAP_S``), so
prefill has dropped the room by then (*dropped*); or prefill makes no sender for it at all and decode
sends at once (*never admitted*). Request 2 (``follow_up``) is served after it. The reverse orphan
(*ended first*) is two requests: decode ends request 0 before prefill opens its room, request 1 is
served after it."""

from sglang_disagg_ext.selftest.harness import nixl_shim
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, Timeouts
from support import plugin_metrics

BOOTSTRAP_S = 6.0  # prefill's bootstrap timeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)
DELAY_S = 8.5  # decode's wait before sending request 1's metadata: past prefill's bootstrap timeout
WAITING_S = 120.0  # decode's waiting timeout: far past the bound, as SGLang's default 300 s is
REQUEST_S = 10.0  # the harness bound per request and side (decode's counts from its metadata)
REFUSED_WITHIN_S = 3.0
LEASE_SLACK_S = 3.0  # the sweeper's one-second tick, and two cores shared by five processes
RUN_BOUND_S = 240
ENDED_FIRST_LABEL = "room ended by decode before prefill opened it"


def _with(reqs, name: str, room_base: int) -> Scenario:
    return Scenario(
        name=name,
        requests=reqs,
        kv=KVPoolSpec(num_pages=14),
        room_base=room_base,
        timeouts=Timeouts(request_s=REQUEST_S, sglang_waiting_s=WAITING_S, sglang_bootstrap_s=BOOTSTRAP_S),
    )


def run(scn: Scenario, backend: str):
    """One harness run. NIXL: both sides register host memory through the harness's shim
    (``harness/nixl_shim.py``; UCX here has no CUDA support), the one replacement in every NIXL test here."""
    return run_scenario(scn, backend, extra_env={nixl_shim.ENV: "1"} if backend.startswith("nixl") else None)


def scenario(room_base: int, follow_up: bool, never_admitted: bool = False) -> Scenario:
    orphan = (dict(prefill_admits=False) if never_admitted else dict(decode_metadata_delay_s=DELAY_S))
    reqs = [RequestSpec(src_kv_pages=[1, 2], dst_kv_pages=[3, 4], aux_index=0),
            RequestSpec(src_kv_pages=[5, 6], dst_kv_pages=[9, 10], aux_index=1, **orphan)]
    if follow_up:
        reqs.append(RequestSpec(src_kv_pages=[7, 8], dst_kv_pages=[11, 12], aux_index=2))
    return _with(reqs, "decode metadata for a room prefill never admitted" if never_admitted else
                 "decode metadata after prefill dropped the room", room_base)


def ended_first_scenario(room_base: int) -> Scenario:
    """Request 0: decode ends it before it reaches prefill (its receiver bootstrapped and aborted, its ABORT
    out for a room prefill has not opened), and prefill opens the room only after that; request 1
    is served as usual after it."""
    return _with([RequestSpec(src_kv_pages=[1, 2], dst_kv_pages=[3, 4], aux_index=0, decode_ends_first=True),
                  RequestSpec(src_kv_pages=[5, 6], dst_kv_pages=[9, 10], aux_index=1)],
                 "decode ended the room before prefill opened it", room_base)


def _refused(result, fix: str, label: str) -> float:
    return plugin_metrics.value(result.plugin_metrics["prefill"], "sglang_disagg_ext_requests_refused_total",
                                fix=fix, reason=label)


def _nothing_written(req) -> bool:
    """Decode's check finds each of the request's own pages "the sentinel (never written)" where its
    bytes would be, and nothing else wrong (the next request's check finds the earlier requests' pages
    still holding their bytes)."""
    return bool(req.mismatches) and all("the sentinel (never written)" in m for m in req.mismatches)


def assert_stock_holds_the_dropped_room(stock):
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


def assert_ext_refuses_the_late_metadata(ext, fix: str):
    assert not ext.error, ext.describe()
    first, dropped, after = ext.requests
    assert first.ok and after.ok, ext.describe()
    assert (dropped.prefill_status, dropped.decode_status) == ("Failed", "Failed"), ext.describe()
    assert dropped.decode_seconds is not None and dropped.decode_seconds < REFUSED_WITHIN_S, ext.describe()
    reason = dropped.decode_failure_reason or ""
    assert f"prefill had already dropped bootstrap_room {dropped.room}" in reason, ext.describe()
    assert "timed out" in reason, ext.describe()  # prefill's own reason travels with it
    assert _nothing_written(dropped), ext.describe()
    assert ext.thread_errors == {"prefill": [], "decode": []}, ext.describe()
    assert _refused(ext, fix, "room dropped by prefill") == 1.0, ext.describe()
    print(f"-ext: room {dropped.room} Failed on decode {dropped.decode_seconds} s after its metadata: {reason}; "
          f"{len(dropped.mismatches)} of its pages checked, each the sentinel")


def assert_stock_waits_for_the_room_never_admitted(stock):
    assert not stock.error, stock.describe()
    first, orphan = stock.requests
    assert first.ok, stock.describe()
    assert orphan.prefill_status == "NotAdmitted", stock.describe()
    assert orphan.decode_status == "WaitingForInput", stock.describe()
    assert orphan.decode_seconds is not None and orphan.decode_seconds >= REQUEST_S - 1.0, stock.describe()
    print(f"stock: decode still {orphan.decode_status} {orphan.decode_seconds} s after its metadata for room "
          f"{orphan.room}, which no prefill request holds")


def assert_ext_releases_the_room_never_admitted(ext, fix: str):
    assert not ext.error, ext.describe()
    first, orphan, after = ext.requests
    assert first.ok and after.ok, ext.describe()
    assert (orphan.prefill_status, orphan.decode_status) == ("NotAdmitted", "Failed"), ext.describe()
    assert orphan.decode_seconds is not None, ext.describe()
    assert BOOTSTRAP_S - 0.5 <= orphan.decode_seconds < BOOTSTRAP_S + LEASE_SLACK_S, ext.describe()
    reason = orphan.decode_failure_reason or ""
    assert f"prefill never admitted bootstrap_room {orphan.room}" in reason, ext.describe()
    assert _nothing_written(orphan), ext.describe()
    assert ext.thread_errors == {"prefill": [], "decode": []}, ext.describe()
    assert _refused(ext, fix, "room never admitted by prefill") == 1.0, ext.describe()
    print(f"-ext: room {orphan.room} Failed on decode {orphan.decode_seconds} s after its metadata: {reason}")


def assert_ext_fails_it_on_opening(ext, fix: str):
    """Room 0 Failed on both sides, on prefill within ``REFUSED_WITHIN_S`` of its opening with the reason
    naming it; nothing written to decode's pages for it; request 1 served, bytes verified; no thread died;
    prefill counted one refusal under ``fix``."""
    assert not ext.error, ext.describe()
    ended, after = ext.requests
    assert after.ok, ext.describe()
    assert (ended.prefill_status, ended.decode_status) == ("Failed", "Failed"), ext.describe()
    assert ended.prefill_seconds is not None and ended.prefill_seconds < REFUSED_WITHIN_S, ext.describe()
    reason = ended.prefill_failure_reason or ""
    assert f"decode ended bootstrap_room {ended.room}" in reason and "before this prefill opened it" in reason, \
        ext.describe()
    assert _nothing_written(ended), ext.describe()
    assert ext.thread_errors == {"prefill": [], "decode": []}, ext.describe()
    assert _refused(ext, fix, ENDED_FIRST_LABEL) == 1.0, ext.describe()
    print(f"-ext: room {ended.room} Failed on prefill {ended.prefill_seconds} s after it opened it: {reason}")


def assert_stock_waits_for_the_room_decode_ended(stock, sender_deadline: bool = True):
    """Stock's ABORT handler ignored the room (no status yet): the request that opened it waited for
    decode's metadata, to the bootstrap timeout where the sender has one (``sender_deadline``), else
    past the bound (still Bootstrapping)."""
    assert not stock.error, stock.describe()
    ended, after = stock.requests
    assert after.ok, stock.describe()
    assert ended.decode_status == "Failed", stock.describe()
    if sender_deadline:
        assert ended.prefill_status == "Failed", stock.describe()
        assert "timed out" in (ended.prefill_failure_reason or ""), stock.describe()
        assert ended.prefill_seconds is not None and ended.prefill_seconds >= BOOTSTRAP_S - 0.5, stock.describe()
    else:
        assert ended.prefill_status == "Bootstrapping", stock.describe()
        assert ended.prefill_seconds is not None and ended.prefill_seconds >= REQUEST_S - 0.5, stock.describe()
    print(f"stock: prefill held room {ended.room}, which decode had ended, for {ended.prefill_seconds} s "
          f"({ended.prefill_status}: {ended.prefill_failure_reason})")
