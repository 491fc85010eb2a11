"""F11 on real NIXL (UCX over 127.0.0.1), 0.5.22 and 0.5.23: stock ``nixl`` vs ``nixl-ext``, P x D rank processes.

Each case runs the same scenario (``selftest/scenarios/nixl_newest.py``, where
every expected text is derived by hand) on stock and on ``-ext``. Decode ranks
check every element of the heads they hold on every destination page and that
every other page still holds the sentinel. Both sides register host memory
through the harness's shim (``harness/nixl_shim.py``): 0.5.23's stock memory
handling, which F11 keeps, refuses host memory across TP sizes before any code
F11 is about runs. Nothing in the code under test is replaced; the
injections are the hooks of ``test/support/prefill_faults.py``, each replacing one manager
method on the instance: the registration-fault case's prefill hook
(``test/support/prefill_faults.py::raise_in_registration``: stock
``_add_remote_peer``'s call to ``_prepare_payload_xfer`` raises once, for
decode TP rank 0, the narrowest point inside one registration).
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
from sglang_disagg_ext.selftest.scenarios import nixl_newest as S
from support import plugin_metrics

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not releases.current_policy().is_live("F11"), reason="F11 is not live on this release"),
    required_part("NIXL", engine_importable("nixl"), "nixl._api does not import"),
]

EXT_MANAGER = "sglang_disagg_ext.backends.nixl.head_sliced.NixlHeadSlicedKVManager"
STOCK_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
SUPPORT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support")
FAULTS = os.path.join(SUPPORT, "prefill_faults.py")
RUN_BOUND_S = 240  # stock and ext run of one case: startup, requests, teardown


@functools.lru_cache(maxsize=None)
def run(builder: str, args: tuple, backend: str, prefill_hook: str = "", decode_hook: str = ""):
    """One run of ``builder(*args)``; a hook named here replaces one manager method on that side
    (``test/support/prefill_faults.py``), as the selftest rows do (``scenarios.nixl_rows``)."""
    env = {nixl_shim.ENV: "1"}
    if prefill_hook:
        env["SGLANG_HARNESS_PREFILL_HOOK"] = f"{FAULTS}:{prefill_hook}"
    if decode_hook:
        env["SGLANG_HARNESS_DECODE_MANAGER_HOOK"] = f"{FAULTS}:{decode_hook}"
    result = run_scenario(getattr(S, builder)(*args), backend, extra_env=env)
    assert result.prefill_manager == (EXT_MANAGER if backend == "nixl-ext" else STOCK_MANAGER), result.describe()
    return result


def ranks(p: int, d: int):
    """The harness's worker names: one per rank, or plain "prefill"/"decode" for TP 1 -> TP 1."""
    if p == d == 1:
        return ["prefill", "decode"]
    return [f"prefill{r}" for r in range(p)] + [f"decode{r}" for r in range(d)]


def joined(names, reason: str) -> str:
    """How the harness reports one reason from several ranks (a single-rank run: the reason alone)."""
    if names in (["prefill"], ["decode"]):
        return reason
    return "; ".join(f"{n}: {reason}" for n in names)


def assert_refused_at_once(result, p: int, d: int, reason: str):
    """Every request Failed on every rank with ``reason``, decode within FAILED_WITHIN_S, no thread died."""
    for r in result.requests:
        assert r.rank_status == {n: "Failed" for n in ranks(p, d)}, result.describe()
        assert r.prefill_failure_reason == joined(ranks(p, 0), reason), result.describe()
        assert r.decode_failure_reason == joined([f"decode{k}" for k in range(d)], reason), result.describe()
        assert r.decode_seconds < S.FAILED_WITHIN_S, result.describe()
        # Refused before any transfer: each targeted element still holds the sentinel (the
        # verifier expected prefill's bytes there) and no other page was written.
        listed = [m for m in r.mismatches if "more mismatching elements not listed" not in m]
        assert listed and all("found the sentinel" in m for m in listed), result.describe()
        assert not any("must be untouched" in m for m in r.mismatches), result.describe()
    assert result.requests[0].thread_errors == [], result.describe()


def timed_out(reason, state: str) -> bool:
    """``reason`` is SGLang's timeout in ``KVPoll.<state>``, after at least the scenario's 5 s
    (SGLang prints the elapsed time with one decimal: 5.1 s and more on a loaded machine)."""
    m = re.search(rf"timed out after (\d+\.\d)s in KVPoll\.{state}\b", reason or "")
    return m is not None and float(m.group(1)) >= S.TIMEOUTS.sglang_waiting_s


def assert_stock_timed_out(result, p: int, d: int, thread_error: str):
    """Stock: the bootstrap thread died with ``thread_error``; every room ends only by SGLang's timeouts."""
    assert any(f"(bootstrap_thread_guarded): {thread_error}" in t for t in result.requests[0].thread_errors), (
        result.describe()
    )
    for r in result.requests:
        assert r.rank_status == {n: "Failed" for n in ranks(p, d)}, result.describe()
        assert timed_out(r.prefill_failure_reason, "Bootstrapping"), result.describe()
        assert timed_out(r.decode_failure_reason, "WaitingForInput"), result.describe()
        assert r.decode_seconds >= S.TIMEOUTS.sglang_waiting_s - 0.5, result.describe()


def assert_listener_survived(ext, prefill_status: str, reason: str):
    """-ext: room 1000 ended on prefill with ``prefill_status`` and Failed on decode with ``reason``
    at once, nothing written outside its pages; room 1001 Success with every byte checked (the
    listener served after the fault); no thread died; one decode-listener recovery counted."""
    bad, good = ext.requests
    assert (bad.prefill_status, bad.decode_status) == (prefill_status, "Failed"), ext.describe()
    assert bad.decode_failure_reason == reason, ext.describe()
    assert bad.decode_seconds < S.FAILED_WITHIN_S, ext.describe()
    assert not any("must be untouched" in m for m in bad.mismatches), ext.describe()
    assert good.ok and good.bytes_verified and good.decode_status == "Success", ext.describe()
    assert all(r.thread_errors == [] for r in ext.requests), ext.describe()
    assert plugin_metrics.value(ext.plugin_metrics["decode"], "sglang_disagg_ext_thread_recoveries_total",
                                role="decode", thread="decode_listener") == 1.0, ext.plugin_metrics


SWA_TOPOLOGIES = [(2, 1), (1, 2), (1, 4), (1, 1)]


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("p,d", SWA_TOPOLOGIES, ids=[f"tp{p}-tp{d}" for p, d in SWA_TOPOLOGIES])
def test_stock_fails_unequal_swa_page_lists(p, d):
    """Stock: requests 0 and 1 Failed on every rank with the length error; request 2 (equal lists) served."""
    result = run("swa_unequal", (p, d), "nixl")
    for index in (0, 1):
        r = result.requests[index]
        want = S.stock_swa_mismatch(p, d, index)
        assert r.rank_status == {n: "Failed" for n in ranks(p, d)}, result.describe()
        assert r.prefill_failure_reason == joined(ranks(p, d)[:p], want), result.describe()
        assert want in r.decode_failure_reason, result.describe()
    assert result.requests[2].ok, result.describe()


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.parametrize("p,d", SWA_TOPOLOGIES, ids=[f"tp{p}-tp{d}" for p, d in SWA_TOPOLOGIES])
def test_ext_aligns_unequal_swa_page_lists_like_mooncake(p, d):
    """-ext: every request Success on every rank, every element of the first min(len) SWA page
    pairs (and of the KV pages) on every decode rank, every other page the sentinel; prefill
    says once what it cut."""
    result = run("swa_unequal", (p, d), "nixl-ext")
    assert result.ok, result.describe()
    for r in result.requests:
        assert r.rank_status == {n: "Success" for n in ranks(p, d)}, result.describe()
        assert r.mismatches == [], result.describe()
    assert any(S.TRIM_LINE in line for line in result.requests[0].prefill_log), result.describe()


@pytest.mark.timeout(RUN_BOUND_S)
def test_three_kv_heads_over_decode_tp2():
    """Stock: a bare AssertionError kills the bootstrap thread, both rooms time out.
    -ext: the decode is refused at registration; both rooms Failed on both sides at once."""
    assert_stock_timed_out(run("three_heads", (), "nixl"), 1, 2, "AssertionError")
    ext = run("three_heads", (), "nixl-ext")
    assert_refused_at_once(ext, 1, 2, S.three_heads_reason())


@pytest.mark.timeout(RUN_BOUND_S)
def test_swa_component_that_cannot_be_sliced_is_named():
    """Stock fails the request at transfer time with SGLang's item-length error (its KV pages
    already sent); -ext refuses the decode at registration naming the SWA component."""
    stock = run("swa_heads", (), "nixl")
    (r,) = stock.requests
    assert r.rank_status == {n: "Failed" for n in ranks(2, 1)}, stock.describe()
    assert r.prefill_failure_reason == joined(ranks(2, 0), S.STOCK_SWA_HEADS), stock.describe()
    assert_refused_at_once(run("swa_heads", (), "nixl-ext"), 2, 1, S.SWA_HEADS_REASON)


@pytest.mark.timeout(RUN_BOUND_S)
def test_bootstrap_thread_survives_a_registration_that_raises():
    """Stock: the injected exception kills the bootstrap thread, both rooms time out. -ext: decode
    rank 0 is refused with the exception as the reason, counted as one bootstrap-thread recovery;
    both rooms Failed on both sides at once, which needs the thread alive after the fault (decode
    rank 1's registration and both rooms' messages come after it)."""
    assert_stock_timed_out(run("registration_fault", (), "nixl", S.PREFILL_HOOK), 1, 2, f"InjectedFault: {S.FAULT}")
    ext = run("registration_fault", (), "nixl-ext", S.PREFILL_HOOK)
    assert_refused_at_once(ext, 1, 2, S.REGISTRATION_FAULT_REASON)
    assert plugin_metrics.value(ext.plugin_metrics["prefill0"], "sglang_disagg_ext_thread_recoveries_total",
                                role="prefill", thread="bootstrap") == 1.0, ext.plugin_metrics


@pytest.mark.timeout(RUN_BOUND_S)
@pytest.mark.skipif(not releases.features().nixl_success_via_listener_only,
                    reason="decode concludes Success from NIXL notifications on this release, so a fault in "
                           "the Success message's handler is never reached; the failed-room case covers it")
def test_decode_listener_survives_a_status_handler_that_raises():
    """Stock: the injected exception kills decode's listener thread; both rooms then end on decode
    only by SGLang's 5 s waiting timeout. -ext: room 1000 Failed on decode at once with the
    exception in the reason (prefill had concluded it Success), counted as one decode-listener
    recovery; room 1001 Success with every byte checked, so the listener served after the fault."""
    stock = run("listener_fault", (), "nixl", decode_hook=S.DECODE_MANAGER_HOOK)
    assert any(f"(decode_listener_thread): InjectedFault: {S.LISTENER_FAULT}" in t
               for t in stock.requests[0].thread_errors), stock.describe()
    for r in stock.requests:
        assert (r.prefill_status, r.decode_status) == ("Success", "Failed"), stock.describe()
        assert timed_out(r.decode_failure_reason, "WaitingForInput"), stock.describe()
        assert r.decode_seconds >= S.TIMEOUTS.sglang_waiting_s - 0.5, stock.describe()

    assert_listener_survived(run("listener_fault", (), "nixl-ext", decode_hook=S.DECODE_MANAGER_HOOK), "Success",
                             S.LISTENER_FAULT_REASON)


@pytest.mark.timeout(RUN_BOUND_S)
def test_decode_listener_survives_a_failure_handler_that_raises():
    """Prefill fails room 1000 (its send_aux raises after the KV pages went out) and tells decode;
    decode's handler of that Failed message raises once. Stock: the exception kills decode's
    listener thread, so decode learns nothing of the failure and room 1000 ends on decode only by
    SGLang's 5 s waiting timeout. -ext: room 1000 Failed on decode at once with the listener fault
    in the reason, counted as one decode-listener recovery; room 1001 Success with every byte
    checked. Both hooks replace one method on the manager instance (``test/support``); nothing
    of the code under test is replaced."""
    stock = run("listener_fault", (), "nixl", S.FAILED_ROOM_PREFILL_HOOK, S.FAILED_ROOM_DECODE_HOOK)
    assert any(f"(decode_listener_thread): InjectedFault: {S.FAILED_ROOM_FAULT}" in t
               for t in stock.requests[0].thread_errors), stock.describe()
    bad = stock.requests[0]
    assert (bad.prefill_status, bad.decode_status) == ("Failed", "Failed"), stock.describe()
    assert timed_out(bad.decode_failure_reason, "WaitingForInput"), stock.describe()
    assert bad.decode_seconds >= S.TIMEOUTS.sglang_waiting_s - 0.5, stock.describe()

    ext = run("listener_fault", (), "nixl-ext", S.FAILED_ROOM_PREFILL_HOOK, S.FAILED_ROOM_DECODE_HOOK)
    assert_listener_survived(ext, "Failed", S.FAILED_ROOM_FAULT_REASON)
