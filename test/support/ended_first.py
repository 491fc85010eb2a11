"""The reverse orphan (decode ended a room before prefill opened it), shared by F17's Mooncake test and
F23's NIXL test: the two requests, and what ``-ext`` must show for them."""

from sglang_disagg_ext.selftest.harness.scenario import RequestSpec
from support import plugin_metrics

LABEL = "room ended by decode before prefill opened it"


def requests():
    """Request 0: decode ends it before it reaches prefill (its receiver bootstrapped and aborted, its
    ABORT out for a room prefill has not opened), and prefill opens the room only after that; request
    1 is served as usual after it."""
    return [RequestSpec(src_kv_pages=[1, 2], dst_kv_pages=[3, 4], aux_index=0, decode_ends_first=True),
            RequestSpec(src_kv_pages=[5, 6], dst_kv_pages=[9, 10], aux_index=1)]


def assert_ext_fails_it_on_opening(ext, fix: str, within_s: float):
    """Room 0 Failed on both sides, on prefill within ``within_s`` of its opening with the reason naming
    it; nothing written to decode's pages for it; request 1 served, bytes verified; no thread died;
    prefill counted one refusal under ``fix``. Returns room 0's record."""
    assert not ext.error, ext.describe()
    ended, after = ext.requests
    assert after.ok, ext.describe()
    assert (ended.prefill_status, ended.decode_status) == ("Failed", "Failed"), ext.describe()
    assert ended.prefill_seconds is not None and ended.prefill_seconds < within_s, ext.describe()
    reason = ended.prefill_failure_reason or ""
    assert f"decode ended bootstrap_room {ended.room}" in reason and "before this prefill opened it" in reason, \
        ext.describe()
    assert ended.mismatches and all("the sentinel (never written)" in m for m in ended.mismatches), ext.describe()
    assert ext.thread_errors == {"prefill": [], "decode": []}, ext.describe()
    assert plugin_metrics.value(ext.plugin_metrics["prefill"], "sglang_disagg_ext_requests_refused_total", fix=fix,
                                reason=LABEL) == 1.0, ext.describe()
    print(f"-ext: room {ended.room} Failed on prefill {ended.prefill_seconds} s after it opened it: {reason}")
    return ended
