"""F24 on real NIXL (UCX over 127.0.0.1): decode's metadata for a room prefill dropped or never admitted.

F17's two Mooncake cases (``test_mooncake_dropped_rooms.py``; scenarios and verdicts:
``test/support/orphan_rooms.py``) on NIXL, prefill TP 1 -> decode TP 1. Dropped: decode sends request
1's metadata ``DELAY_S`` after bootstrapping, past prefill's bootstrap timeout (``BOOTSTRAP_S``), when
prefill has failed the room with no decode address to tell. Never admitted: prefill makes no sender for
request 1 and decode sends its metadata at once.

Stock (every release; covered 0.5.20-0.5.23, run by hand on 0.5.20 and 0.5.23): the bootstrap loop stores the
metadata for a room no request will serve (0.5.23 nixl/conn.py:3392-3411) and decode holds request 1's
pages in WaitingForInput: still there at the harness bound, with SGLang's waiting timeout far past it.
``nixl-ext``: the late metadata is answered with Failed at once (the reason names the room and
prefill's bootstrap timeout); the never-admitted room after a lease of the bootstrap timeout; decode's
pages for request 1 all hold the sentinel; requests 0 and 2 byte-verified; no thread died;
``requests_refused_total{fix="F24"}`` is 1 on prefill.

The one replacement: both sides register host memory through the harness's shim (``orphan_rooms.run``).
"""

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from support import orphan_rooms as O

POLICY = releases.current_policy()
pytestmark = [
    pytest.mark.engine,
    # Before 0.5.20 a NIXL decode reads no Failed status from prefill: nothing to answer with.
    pytest.mark.skipif(not POLICY.is_live("F24"), reason=f"F24 is not covered on SGLang {POLICY.version} (0.5.20+)"),
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
]
ROOM_BASE = 2400


def _run(backend: str, follow_up: bool, never_admitted: bool = False):
    return O.run(O.scenario(ROOM_BASE, follow_up, never_admitted), backend)


@pytest.mark.timeout(O.RUN_BOUND_S)
def test_stock_decode_holds_the_dropped_room_past_the_bound():
    O.assert_stock_holds_the_dropped_room(_run("nixl", follow_up=False))


@pytest.mark.timeout(O.RUN_BOUND_S)
def test_ext_refuses_the_late_metadata_at_once_and_serves_on():
    O.assert_ext_refuses_the_late_metadata(_run("nixl-ext", follow_up=True), "F24")


@pytest.mark.timeout(O.RUN_BOUND_S)
def test_stock_decode_waits_for_a_room_prefill_never_admitted():
    O.assert_stock_waits_for_the_room_never_admitted(_run("nixl", follow_up=False, never_admitted=True))


@pytest.mark.timeout(O.RUN_BOUND_S)
def test_ext_releases_a_room_never_admitted_after_the_lease_and_serves_on():
    O.assert_ext_releases_the_room_never_admitted(_run("nixl-ext", follow_up=True, never_admitted=True), "F24")


@pytest.mark.timeout(420)
def test_soak_with_orphan_rooms_stock_decode_never_told_ext_all_judged_right():
    """The soak (``selftest.soak``, one rank a side, 64 requests in waves of 32, no restart) with a share of
    requests prefill never admits among out-of-pool indices and duplicate rooms: with ``nixl-ext`` every
    request ends as the judge requires (each faulted one Failed with a reason, decode told of each orphan
    by prefill's lease, every other one Success with every byte right, nothing written outside the
    targeted pages); stock's decode ends each orphan on its own waiting timeout, never told."""
    from sglang_disagg_ext.selftest import soak

    # Seed 4: of wave 0's requests, 2 out-of-pool, 3 duplicate rooms, 2 never admitted (wave 1 is clean).
    cfg = soak.SoakConfig(requests=64, wave=32, fault_rate=0.0, bad_rate=1 / 32, duplicate_rate=1 / 16,
                          orphan_rate=1 / 16, seed=4, restart_decode=False)
    ext = soak.run_soak("nixl-ext", cfg)
    assert ext["passed"], soak.format_summaries([ext])
    assert ext["faults_injected"]["never_admitted"] > 0 and ext["faults_injected"]["duplicate_room"] > 0
    assert ext["outcomes"]["failed_as_faulted"] == sum(ext["faults_injected"].values()), soak.format_summaries([ext])
    assert ext["outcomes"]["ok"] == cfg.requests - ext["outcomes"]["failed_as_faulted"] and not ext["stray_writes"]

    stock = soak.run_soak("nixl", cfg)
    assert not stock["passed"], soak.format_summaries([stock, ext])
    assert stock["outcomes"]["decode_not_told"] == ext["faults_injected"]["never_admitted"], \
        soak.format_summaries([stock, ext])
    print(soak.format_summaries([stock, ext]))
