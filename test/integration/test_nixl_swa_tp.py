"""F13 on real NIXL (UCX over 127.0.0.1), 0.5.13-0.5.21: SWA state across attention TP sizes, stock ``nixl`` vs ``nixl-ext``.

Up to 0.5.16 F13's class also slices the KV heads of a decode that replicates them (decode TP
size above the KV heads), where stock's prepared slice lists kill prefill's bootstrap thread:
a KV-only TP 1 -> 4 case shows that on its own.

One process per rank, prefill TP 2 -> decode TP 1, 1 -> 2 and 1 -> 4, a model with 2 KV
heads whose SWA window cache is sharded like its KV (``scenarios.nixl.swa_tp_scenario``: KV
pages 1-3 -> 5-7, SWA state pages 2, 3 -> 8, 9, aux row 1 -> 2). Decode ranks check every
element of the heads they hold on every destination page, KV and SWA alike, against the
placement the harness derives from the sharding rule (``harness/patterns.py``), and that every
other page still holds its sentinel.

Stock raises "PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA hybrid
models yet." on each prefill rank, per request (0.5.13 nixl/conn.py:1616-1618 ... 0.5.21
:2674-2676); decode is told from 0.5.20 (``conclude_failure``), before that it ends the room
only by SGLang's waiting timeout. ``nixl-ext`` (``backends/nixl/swa_tp.py``) sends the window
cache as head slices. The one replacement: both sides register host memory through the
harness's shim (``harness/nixl_shim.py``), since UCX here has no CUDA support and stock
registers the pools as "VRAM"; ``nixl-ext`` keeps stock's memory handling, so it gets the same
shim. Nothing in the code under test is replaced.

The bootstrap-thread case (F13's class shares F11's registration refusal,
``backends/nixl/registration.py``) injects one exception with the hook of
``test/support/prefill_faults.py::raise_in_registration``: stock
``_add_remote_peer``'s call to ``_prepare_payload_xfer`` raises once, for decode TP rank 0,
the narrowest point inside one registration.
"""

import functools
import os
import re

import pytest
from conftest import required_part

from sglang_disagg_ext import releases
from sglang_disagg_ext.doctor import engine_importable
from sglang_disagg_ext.selftest.harness import nixl_shim
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.scenarios import nixl as S
from sglang_disagg_ext.selftest.scenarios import nixl_newest as N
from support import plugin_metrics

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not releases.current_policy().is_live("F13"), reason="F13 is not live on this release"),
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
]

EXT_MANAGER = "sglang_disagg_ext.backends.nixl.swa_tp.NixlSwaTpKVManager"
STOCK_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
REFUSAL = "PD Disaggregation does NOT support PD different TP sizes for non-MLA SWA hybrid models yet."
RUN_BOUND_S = 240  # one run: startup, one request (stock: up to SGLang's waiting timeout), teardown


HEADS = 2  # the scenarios' total KV heads (swa_tp_scenario's and kv_replicas' default)
NOT_FOUND = "(bootstrap_thread): nixlNotFoundError: NIXL_ERR_NOT_FOUND"


def kv_replicas():
    """KV only, prefill TP 1 -> decode TP 4, 2 KV heads: each head on two decode ranks."""
    return S.tp_scenario(1, 4, HEADS, chunks=1)


@functools.lru_cache(maxsize=None)
def run(p: int, d: int, backend: str, kv_only: bool = False):
    scenario = kv_replicas() if kv_only else S.swa_tp_scenario(p, d)
    result = run_scenario(scenario, backend, extra_env={nixl_shim.ENV: "1"})
    assert result.prefill_manager == (EXT_MANAGER if backend == "nixl-ext" else STOCK_MANAGER), result.describe()
    assert result.decode_manager == result.prefill_manager, result.describe()
    return result


def ranks(p: int, d: int):
    return [f"prefill{r}" for r in range(p)] + [f"decode{r}" for r in range(d)]


def per_rank(names, text: str) -> str:
    """How the harness joins one reason reported by several ranks."""
    return "; ".join(f"{n}: {text}" for n in names) if len(names) > 1 else f"{names[0]}: {text}"


def assert_bootstrap_thread_died(result, d: int):
    """Stock up to 0.5.16 with a decode replicating KV heads: prefill's bootstrap thread died with
    NIXL_ERR_NOT_FOUND while preparing that decode's slice lists (0.5.16 nixl/conn.py:771-776 lay
    out one head group per decode rank); the room never leaves Bootstrapping on prefill and every
    decode rank ends it by SGLang's waiting timeout."""
    (r,) = result.requests
    assert any(NOT_FOUND in t for t in r.thread_errors), result.describe()
    assert r.rank_status["prefill0"] == "Bootstrapping", result.describe()
    waited = S.FIVE_RANK_TIMEOUTS.sglang_waiting_s  # 1 + 4 ranks: tp_scenario's timeouts for five processes
    for k in range(d):
        assert r.rank_status[f"decode{k}"] == "Failed", result.describe()
        assert f"decode{k}: Request 1000 timed out" in r.decode_failure_reason, result.describe()
    assert r.decode_seconds >= waited - 0.5, result.describe()


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(releases.features().stock_nixl_prep_serves_decode_replicas,
                    reason="n/a: stock NIXL's prepared KV slice lists serve decode replicas here (0.5.17+)")
def test_stock_kv_to_replicating_decode_kills_the_bootstrap_thread_ext_serves_it():
    """KV only, TP 1 -> TP 4 with 2 KV heads (0.5.13-0.5.16): stock's bootstrap thread dies and the
    room times out; -ext slices those KV heads per chunk: Success on every rank, every element of
    each decode rank's head checked, every other page its sentinel."""
    assert_bootstrap_thread_died(run(1, 4, "nixl", kv_only=True), 4)
    ext = run(1, 4, "nixl-ext", kv_only=True)
    (r,) = ext.requests
    assert ext.ok and r.rank_status == {n: "Success" for n in ranks(1, 4)}, ext.describe()
    assert r.bytes_verified and r.mismatches == [] and r.thread_errors == [], ext.describe()


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("p,d", S.F13_TOPOLOGIES, ids=[f"tp{p}-tp{d}" for p, d in S.F13_TOPOLOGIES])
def test_stock_refuses_swa_state_across_tp_sizes(p, d):
    """Stock: every prefill rank fails the request with the refusal; decode is told (0.5.20+) or
    waits out SGLang's waiting timeout; the SWA state pages keep their sentinel. (TP 1 -> 4 up to
    0.5.16: the KV registration kills the bootstrap thread first, see below.)"""
    result = run(p, d, "nixl")
    (r,) = result.requests
    if d > HEADS and not releases.features().stock_nixl_prep_serves_decode_replicas:
        # 0.5.13-0.5.16: the decode replicates KV heads, and stock's prepared KV slice lists
        # already kill prefill's bootstrap thread at registration (test_stock_kv_to_replicating_decode).
        assert_bootstrap_thread_died(result, d)
        return
    assert r.rank_status == {n: "Failed" for n in ranks(p, d)}, result.describe()
    assert r.prefill_failure_reason == per_rank([f"prefill{k}" for k in range(p)], REFUSAL), result.describe()
    decode_ranks = [f"decode{k}" for k in range(d)]
    timeouts = S.swa_tp_scenario(p, d).timeouts
    if releases.features().stock_nixl_worker_tells_decode:
        assert r.decode_failure_reason == per_rank(decode_ranks, REFUSAL), result.describe()
        assert r.decode_seconds < timeouts.sglang_waiting_s, result.describe()
    else:
        for name in decode_ranks:
            assert f"{name}: " in r.decode_failure_reason and "timed out" in r.decode_failure_reason, result.describe()
        assert r.decode_seconds >= timeouts.sglang_waiting_s - 0.5, result.describe()
    state = [m for m in r.mismatches if "state0:swa" in m and "more mismatching" not in m]
    assert state and all("found the sentinel" in m for m in state), result.describe()
    assert not any("must be untouched" in m for m in r.mismatches), result.describe()


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("p,d", S.F13_TOPOLOGIES, ids=[f"tp{p}-tp{d}" for p, d in S.F13_TOPOLOGIES])
def test_ext_sends_swa_state_as_head_slices(p, d):
    """-ext: Success on every rank, every element of every KV and SWA head on every destination
    page as placed by the sharding rule, every other page its sentinel, no thread error."""
    result = run(p, d, "nixl-ext")
    (r,) = result.requests
    assert result.ok, result.describe()
    assert r.rank_status == {n: "Success" for n in ranks(p, d)}, result.describe()
    assert r.bytes_verified and r.mismatches == [], result.describe()
    assert r.thread_errors == [], result.describe()


@pytest.mark.timeout(RUN_BOUND_S)
def test_swa_pool_that_cannot_be_sliced_is_refused_at_registration():
    """An SWA pool with one head under a two-head model, prefill TP 2 -> decode TP 1
    (``scenarios.nixl_newest.swa_heads``: 16 bytes per head per token on prefill, 8 on decode).
    Stock: each prefill rank fails the request with its per-request refusal, at transfer time.
    -ext: the decode rank is refused at registration, before any request is accepted, with one
    reason naming the SWA component, both TP sizes and the head bytes that differ (written out
    by hand in the scenario module); prefill's rooms Failed at once, decode told at once (up to
    0.5.19 by the plugin's own failure message); nothing written to decode (every
    targeted KV and SWA element still its sentinel, no other page touched); no thread error."""
    env = {nixl_shim.ENV: "1"}
    stock = run_scenario(N.swa_heads(), "nixl", extra_env=env)
    assert stock.prefill_manager == STOCK_MANAGER, stock.describe()
    (r,) = stock.requests
    assert r.rank_status == {n: "Failed" for n in ranks(2, 1)}, stock.describe()
    assert r.prefill_failure_reason == per_rank(["prefill0", "prefill1"], REFUSAL), stock.describe()

    ext = run_scenario(N.swa_heads(), "nixl-ext", extra_env=env)
    assert ext.prefill_manager == EXT_MANAGER, ext.describe()
    (r,) = ext.requests
    assert r.rank_status == {n: "Failed" for n in ranks(2, 1)}, ext.describe()
    assert r.prefill_failure_reason == per_rank(["prefill0", "prefill1"], N.SWA_HEADS_REASON), ext.describe()
    assert r.decode_failure_reason == per_rank(["decode0"], N.SWA_HEADS_REASON), ext.describe()
    assert r.decode_seconds < N.FAILED_WITHIN_S, ext.describe()
    listed = [m for m in r.mismatches if "more mismatching elements not listed" not in m]
    assert any("state0:swa" not in m for m in listed) and all("found the sentinel" in m for m in listed), (
        ext.describe())
    assert not any("must be untouched" in m for m in r.mismatches), ext.describe()
    assert r.thread_errors == [], ext.describe()


FAULTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "prefill_faults.py")


def _timed_out(reason, state: str) -> bool:
    """SGLang's timeout in ``KVPoll.<state>`` after at least the scenario's waiting timeout."""
    m = re.search(rf"timed out after (\d+\.\d)s in KVPoll\.{state}\b", reason or "")
    return m is not None and float(m.group(1)) >= N.TIMEOUTS.sglang_waiting_s


@pytest.mark.timeout(RUN_BOUND_S)
def test_bootstrap_thread_survives_a_registration_that_raises():
    """KV only, prefill TP 1 -> decode TP 2, two rooms; decode rank 0's registration raises once.
    Stock: the exception ends prefill's bootstrap thread (0.5.13-0.5.20 ``bootstrap_thread``,
    0.5.21 ``bootstrap_thread_guarded`` logs and re-raises), and both rooms end on every rank
    only by SGLang's timeouts (prefill in Bootstrapping, decode in WaitingForInput); up to 0.5.17
    stock's NIXL sender has no bootstrap deadline, and prefill's rooms never leave
    Bootstrapping. -ext: decode
    rank 0 is refused with the exception as the reason, counted as one bootstrap-thread
    recovery; both rooms Failed on prefill at once, which needs the thread alive after the
    fault (decode rank 1's registration and both rooms' messages come after it); decode is told
    at once (``conclude_failure`` from 0.5.20; up to 0.5.19, where no NIXL message tells decode of
    a failure, the plugin's own failure message); nothing written to decode."""
    env = {nixl_shim.ENV: "1", "SGLANG_HARNESS_PREFILL_HOOK": f"{FAULTS}:{N.PREFILL_HOOK}"}
    stock = run_scenario(N.registration_fault(), "nixl", extra_env=env)
    assert stock.prefill_manager == STOCK_MANAGER, stock.describe()
    died = re.compile(r"\(bootstrap_thread(_guarded)?\): InjectedFault: " + re.escape(N.FAULT))
    assert any(died.search(t) for t in stock.requests[0].thread_errors), stock.describe()
    deadline = releases.features().stock_nixl_sender_bootstrap_deadline
    for r in stock.requests:
        assert r.rank_status == {"prefill0": "Failed" if deadline else "Bootstrapping", "decode0": "Failed",
                                 "decode1": "Failed"}, stock.describe()
        if deadline:
            assert _timed_out(r.prefill_failure_reason, "Bootstrapping"), stock.describe()
        assert _timed_out(r.decode_failure_reason, "WaitingForInput"), stock.describe()

    ext = run_scenario(N.registration_fault(), "nixl-ext", extra_env=env)
    assert ext.prefill_manager == EXT_MANAGER, ext.describe()
    for r in ext.requests:
        assert r.rank_status == {n: "Failed" for n in ranks(1, 2)}, ext.describe()
        assert r.prefill_failure_reason == per_rank(["prefill0"], N.REGISTRATION_FAULT_REASON), ext.describe()
        # (prefill's reason is the refusal, not SGLang's bootstrap timeout: refused, not waited out)
        assert r.decode_failure_reason == per_rank(["decode0", "decode1"], N.REGISTRATION_FAULT_REASON), (
            ext.describe())
        assert r.decode_seconds < N.FAILED_WITHIN_S, ext.describe()
        listed = [m for m in r.mismatches if "more mismatching elements not listed" not in m]
        assert listed and all("found the sentinel" in m for m in listed), ext.describe()
    assert all(r.thread_errors == [] for r in ext.requests), ext.describe()
    assert plugin_metrics.value(ext.plugin_metrics["prefill0"], "sglang_disagg_ext_thread_recoveries_total",
                                role="prefill", thread="bootstrap") == 1.0, ext.plugin_metrics


def _two_rooms(prefill_hook: str, backend: str):
    """TP 1 -> 1, rooms 1000 and 1001 (``N.listener_fault``), with one ``test/support`` prefill hook."""
    env = {nixl_shim.ENV: "1", "SGLANG_HARNESS_PREFILL_HOOK": f"{FAULTS}:{prefill_hook}"}
    result = run_scenario(N.listener_fault(), backend, extra_env=env)
    assert result.prefill_manager == (EXT_MANAGER if backend == "nixl-ext" else STOCK_MANAGER), result.describe()
    return result


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(releases.features().nixl_conclude_failure,
                    reason="n/a: from 0.5.20 stock NIXL tells decode of a prefill-side failure (conclude_failure)")
def test_prefill_side_failure_reaches_decode_at_once():
    """TP 1 -> 1, two rooms; prefill's transfer worker raises once in room 1000's ``send_aux``
    (after its KV pages were posted; hook ``raise_in_nixl_send_aux`` of ``test/support``).
    Stock up to 0.5.19: prefill fails room 1000 with the exception, but no NIXL message tells
    decode, which ends it only by its waiting timeout; up to 0.5.15 decode's abort of that room
    then kills prefill's bootstrap thread (its loop asserts on the unguarded ``ABORT``), and room
    1001 is lost too. -ext: decode ends room 1000 Failed at once with prefill's reason (the
    plugin's failure message), writes nothing outside its pages, and room 1001 is Success with
    every byte checked (up to 0.5.15 after the plugin took decode's abort off the loop)."""
    stock = _two_rooms(N.FAILED_ROOM_PREFILL_HOOK, "nixl")
    bad, good = stock.requests
    assert (bad.prefill_status, bad.decode_status) == ("Failed", "Failed"), stock.describe()
    assert bad.prefill_failure_reason == N.SEND_AUX_FAULT, stock.describe()
    assert _timed_out(bad.decode_failure_reason, "WaitingForInput"), stock.describe()
    if releases.features().nixl_bootstrap_handles_abort:
        assert good.ok and good.bytes_verified, stock.describe()
    else:
        # Up to 0.5.15 decode's abort of the timed-out room kills prefill's bootstrap thread
        # (0.5.13 nixl/conn.py:1849-1851), so room 1001 is never served either.
        died = [t for r in stock.requests for t in r.thread_errors]
        assert any("(bootstrap_thread): AssertionError: First message should be" in t for t in died), stock.describe()
        assert good.decode_status == "Failed", stock.describe()

    ext = _two_rooms(N.FAILED_ROOM_PREFILL_HOOK, "nixl-ext")
    bad, good = ext.requests
    assert (bad.prefill_status, bad.decode_status) == ("Failed", "Failed"), ext.describe()
    assert bad.prefill_failure_reason == N.SEND_AUX_FAULT, ext.describe()
    assert bad.decode_failure_reason == N.SEND_AUX_FAULT, ext.describe()
    assert bad.decode_seconds < N.FAILED_WITHIN_S, ext.describe()
    assert not any("must be untouched" in m for m in bad.mismatches), ext.describe()
    assert good.ok and good.bytes_verified and good.decode_status == "Success", ext.describe()
    assert all(r.thread_errors == [] for r in ext.requests), ext.describe()


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(releases.features().nixl_bootstrap_handles_abort,
                    reason="n/a: from 0.5.16 stock's bootstrap loop handles decode's ABORT message")
def test_decode_abort_does_not_end_the_bootstrap_thread():
    """TP 1 -> 1, two rooms; room 1000's transfer is lost on prefill (hook ``lose_first_transfer``
    of ``test/support``), so decode ends it by its waiting timeout and, as SGLang does, sends
    ``ABORT`` for it to prefill's bootstrap socket. Stock up to 0.5.15: the bootstrap loop asserts
    on the unguarded message and dies, so room 1001 is never served. -ext: the abort is handled
    (room 1000 Failed on prefill with SGLang's abort reason) and room 1001 is Success with every
    byte checked; no thread died."""
    stock = _two_rooms(N.LOST_TRANSFER_HOOK, "nixl")
    lost, after = stock.requests
    assert _timed_out(lost.decode_failure_reason, "WaitingForInput"), stock.describe()
    died = [t for r in stock.requests for t in r.thread_errors]
    assert any("(bootstrap_thread): AssertionError: First message should be" in t for t in died), stock.describe()
    assert after.decode_status == "Failed", stock.describe()

    ext = _two_rooms(N.LOST_TRANSFER_HOOK, "nixl-ext")
    lost, after = ext.requests
    assert _timed_out(lost.decode_failure_reason, "WaitingForInput"), ext.describe()
    assert lost.prefill_failure_reason == N.ABORT_REASON, ext.describe()
    # The lost room's chunks were never queued: no page outside its own was written (the harness checks
    # every page no request targets against its sentinel).
    assert not any("must be untouched" in m for m in lost.mismatches), ext.describe()
    assert after.ok and after.bytes_verified and after.decode_status == "Success", ext.describe()
    assert all(r.thread_errors == [] for r in ext.requests), ext.describe()
