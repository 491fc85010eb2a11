"""F16 on real engines (Mooncake over TCP, NIXL over UCX; 127.0.0.1), every release 0.5.10.post1-0.5.23.

Two requests, A (index 0) then B (index 1), name the same bootstrap room, as a client that posts
to both servers itself may (upstream sgl-project/sglang#40125). Both are live at once (one wave):
each side makes A's sender/receiver, then B's, then sends, then polls both to a final state, as a
scheduler holding both does. A and B have their own source pages, decode pages and aux rows;
decode checks every page byte for byte.

Stock (every release: nothing refuses a room in use under the default decode allocation policy):
B is admitted into A's room. The two share one status and prefill keeps one page list per decode
session for the room: on 0.5.23 A's bytes land in B's pages, A's are never written, both report
Success; on NIXL 0.5.11 prefill's poll of B raises ``KeyError`` (the room popped under it), the
upstream crash; on NIXL 0.5.16 A's bytes land in B's pages, decode reports A Success, and prefill's
transfer worker asserts; in a CI run on NIXL 0.5.19 A was served and prefill reported B Success
while B's bytes never reached decode (decode waited it out). The signature: decode reported
Success for a request whose pages do not hold its bytes, or the two sides disagree (one Success,
the other Failed), or a ``KeyError`` raised into the caller.
``-ext``: B ends Failed on prefill and on decode at once, each with a reason naming the room;
A is Success with every byte checked; B's decode pages still hold the sentinel (nothing was
written for it); no thread died.

NIXL's one replacement, as in every NIXL test here: host memory registered through the
harness's shim (``harness/nixl_shim.py``; UCX here has no CUDA support).
"""

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness import nixl_shim
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, Timeouts
from support import plugin_metrics

POLICY = releases.current_policy()
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not POLICY.is_live("F16"), reason=f"F16 is not live on SGLang {POLICY.version}"),
]
ROOM = 4242
RUN_BOUND_S = 240  # one run: startup, one wave of two requests, teardown
BACKENDS = [
    pytest.param("mooncake", marks=required_part("Mooncake", engine_importable("mooncake"),
                                                 "mooncake.engine does not import")),
    pytest.param("nixl", marks=required_part("NIXL", engine_importable("nixl"), "nixl._api does not import")),
]


def _scenario() -> Scenario:
    # A: source pages 1, 2 -> decode pages 3, 4, aux row 0; B: 5, 6 -> 9, 10, aux row 1.
    return Scenario(
        name="duplicate bootstrap room",
        requests=[RequestSpec(src_kv_pages=[1, 2], dst_kv_pages=[3, 4], aux_index=0, room=ROOM),
                  RequestSpec(src_kv_pages=[5, 6], dst_kv_pages=[9, 10], aux_index=1, room=ROOM)],
        kv=KVPoolSpec(num_pages=12),
        wave=2,
        shared_rooms=True,
        timeouts=Timeouts(request_s=30.0, sglang_waiting_s=8.0, sglang_bootstrap_s=8.0),
    )


def _run(backend: str):
    env = {nixl_shim.ENV: "1"} if backend.startswith("nixl") else None
    return run_scenario(_scenario(), backend, extra_env=env)


def _stray_writes(result):
    return [s for wave in result.waves.get("decode", []) for s in wave.get("stray_writes", [])]


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stock_admits_a_second_request_into_a_room_in_use(backend):
    stock = _run(backend)
    assert not stock.error, stock.describe()
    a, b = stock.requests
    for r in (a, b):  # nothing refused either: no reason names the room as taken
        assert "already in use" not in f"{r.prefill_failure_reason} {r.decode_failure_reason}", stock.describe()
    # The signature, by interleaving: decode reported Success for a request whose pages do not hold
    # its bytes (B's page list overwrote A's on prefill); or the two sides disagree (prefill reported
    # Success for a request whose bytes never reached decode, which then waited it out: B shared
    # A's status); or a poll raised KeyError into the caller (the room popped under the other).
    wrong = [r.index for r in (a, b) if r.decode_status == "Success" and not r.bytes_verified]
    disagree = [r.index for r in (a, b) if {r.prefill_status, r.decode_status} == {"Success", "Failed"}]
    raised = [r.index for r in (a, b) if "KeyError" in (r.error or "")]
    assert wrong or disagree or raised, stock.describe()
    print(f"stock {backend}: decode Success with wrong bytes: {wrong}; sides disagree: {disagree}; "
          f"KeyError raised into the caller: {raised}")


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ext_refuses_the_second_and_serves_the_first(backend):
    ext = _run(f"{backend}-ext")
    assert not ext.error, ext.describe()
    a, b = ext.requests
    assert a.ok, ext.describe()
    assert (b.prefill_status, b.decode_status) == ("Failed", "Failed"), ext.describe()
    for side, reason in (("prefill", b.prefill_failure_reason), ("decode", b.decode_failure_reason)):
        assert reason and f"bootstrap_room {ROOM} is already in use by a live request on this {side}" in reason, (
            side, ext.describe())
    # B's decode pages 9, 10 and aux row 1 hold the sentinel: nothing was written for it.
    assert not _stray_writes(ext), ext.describe()
    assert ext.thread_errors == {"prefill": [], "decode": []}, ext.describe()
    for side in ("prefill", "decode"):
        assert plugin_metrics.value(ext.plugin_metrics[side], "sglang_disagg_ext_requests_refused_total",
                                    fix="F16", reason="duplicate bootstrap room") == 1.0, (side, ext.describe())
