"""F6 scenarios: a request with an out-of-pool decode index, then three valid requests to the same decode.

Stock (every release where F6 is live): the engine fails the bad request's
transfer and prefill marks decode's whole Mooncake session failed after that
single failure, so each valid request after it fails on both sides (prefill's reason:
"Decode instance could be dead, remote mooncake session <id> is not alive").
``-ext``: the bad request is refused before the engine, Failed on both sides
within a bound, with a reason naming the component, the index and the pool
size; decode holds nothing it wrote; the three valid requests pass,
verified byte for byte.

A third scenario has a *valid* first request whose one KV write the engine
fails (``Scenario.dropped_kv_pages``, ``harness.faults``: a link that drops a
write). Stock blacklists the session the same way; ``-ext`` fails that request
on both sides with stock's engine-failure reason, probes the peer, finds it
alive and keeps the session: the three valid requests pass.

Expected reasons are written out by hand from each scenario's numbers.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.scenario import (
    KVPoolSpec,
    RequestSpec,
    Scenario,
    StatePoolSpec,
    StateSpec,
)
from sglang_disagg_ext.selftest.scenarios.mooncake import FAILED_WITHIN_S, BuiltinScenario, refused_request_problem

KV_PAGES = 12
SWA_PAGES = 8
STOCK_NOT_ALIVE = "is not alive"


def _valid(state: bool) -> List[RequestSpec]:
    """Three good requests on pages no other request of the scenario targets."""
    def st(src, dst):
        return [StateSpec("swa", src, dst)] if state else []

    return [
        RequestSpec([3, 4], [5, 6], aux_index=1, dst_aux_index=1, state=st([1, 2], [3, 4])),
        RequestSpec([5], [7], aux_index=2, dst_aux_index=2, state=st([3], [5])),
        RequestSpec([6, 7], [8, 9], aux_index=3, dst_aux_index=3, state=st([4, 5], [6, 7])),
    ]


def _scenario(name: str, bad: RequestSpec, state: bool) -> Scenario:
    return Scenario(
        name=name,
        requests=[bad] + _valid(state),
        kv=KVPoolSpec(num_pages=KV_PAGES),
        state_pools=[StatePoolSpec(kind="swa", num_pages=SWA_PAGES)] if state else [],
    )


def _bad_kv(policy: releases.ReleasePolicy) -> Scenario:
    # Decode page 40 of a 12-page pool, second of two.
    bad = RequestSpec([1, 2], [2, 40], aux_index=0, dst_aux_index=0, allow_out_of_pool=True)
    return _scenario("bad kv page, then 3 good", bad, state=False)


def _bad_state(policy: releases.ReleasePolicy) -> Scenario:
    # KV pages fine; SWA decode page 8 of an 8-page pool (one past the end), third of three.
    bad = RequestSpec(
        [1, 2], [2, 10], aux_index=0, dst_aux_index=0,
        state=[StateSpec("swa", [0, 1, 2], [0, 1, 8])], allow_out_of_pool=True,
    )
    return _scenario("bad swa state page, then 3 good", bad, state=True)


def _dropped_write(policy: releases.ReleasePolicy) -> Scenario:
    # A valid request (decode pages 10, 11 of 12) whose writes into decode page 11 the engine fails.
    first = RequestSpec([1, 2], [10, 11], aux_index=0, dst_aux_index=0, fault="engine")
    return dataclasses.replace(_scenario("dropped write, then 3 good", first, state=False), dropped_kv_pages=[11])


def dropped_write_problem(result) -> Optional[str]:
    """None when request 0 ended Failed on both sides with stock's engine-failure reason and
    nothing landed outside its pages, and requests 1.. all passed byte for byte."""
    if result.error or len(result.requests) < 2:
        return f"run error or too few requests: {result.error}"
    first, good = result.requests[0], result.requests[1:]
    if not first.failed_within(FAILED_WITHIN_S):
        return (f"request 0: not Failed on both sides within {FAILED_WITHIN_S}s (prefill={first.prefill_status} "
                f"{first.prefill_seconds}, decode={first.decode_status} {first.decode_seconds})")
    if "Failed to send kv chunk" not in (first.prefill_failure_reason or ""):
        return f"request 0: prefill reason {first.prefill_failure_reason!r} is not the engine failure"
    # The verifier expected its bytes on every page and row it targets: each of those
    # holds either them or the sentinel (its page 11 was dropped, what else landed
    # before the failure depends on the engine's batches); anything else is a stray.
    stray = [m for m in first.mismatches if "found the sentinel" not in m]
    if stray:
        return f"request 0: decode written outside its pages: {stray}"
    for r in good:
        if not r.ok:
            return f"request {r.index}: not ok (prefill={r.prefill_status} decode={r.decode_status} bytes={r.bytes_verified})"
    return None


# Exactly what -ext reports for each bad request (core.index_bounds wording).
REFUSALS = {
    "bad kv page, then 3 good":
        "kv: destination index 40 (position 1 of 2) outside decode's pool of 12 pages (valid 0..11)",
    "bad swa state page, then 3 good":
        "state component 0 (swa): destination index 8 (position 2 of 3) outside decode's pool of 8 entries "
        "(valid 0..7)",
}


def _refused_then_served(name: str):
    want = REFUSALS[name]

    def passed(result) -> bool:
        return refusal_problem(result, want) is None

    return passed


def refusal_problem(result, want: str, decode_want: Optional[str] = None) -> Optional[str]:
    """None when request 0 was refused the -ext way and requests 1.. all passed; else why not.
    ``decode_want``: decode's reason where it differs (a stock decode, which is sent no reason)."""
    if result.error or len(result.requests) < 2:
        return f"run error or too few requests: {result.error}"
    bad, good = result.requests[0], result.requests[1:]
    problem = refused_request_problem(bad, want, decode_want)
    if problem:
        return problem
    for r in good:
        if not r.ok:
            return f"request {r.index}: not ok (prefill={r.prefill_status} decode={r.decode_status} bytes={r.bytes_verified})"
    return None


def _stock_signature(result, policy) -> Optional[str]:
    """Stock: request 0 fails in the engine (prefill: "Failed to send kv chunk" or "Failed to send
    state components"), and every valid request after it fails on both sides with the
    blacklisted-session reason. Byte mismatches are not part of the shape: besides
    the missing pages of the failed requests, stock's out-of-pool KV page can land
    in another registered buffer (seen on 0.5.23: KV buffer 3 page 3 overwritten by
    the write meant for buffer 2 page 40), depending on where the pools lie."""
    bad, good = result.requests[0], result.requests[1:]
    carries_state = any(t != "none" for t in result.state_types)  # flat layout registers "none"
    if carries_state and not releases.features().stock_mooncake_checks_state_send:
        return _unchecked_state_signature(result)
    if bad.prefill_status != "Failed" or bad.decode_status != "Failed":
        return f"request 0: prefill={bad.prefill_status} decode={bad.decode_status}, the live bug fails it in the engine"
    if "Failed to send" not in (bad.prefill_failure_reason or ""):
        return f"request 0: prefill reason {bad.prefill_failure_reason!r} is not the engine failure"
    for r in good:
        if r.prefill_status != "Failed" or r.decode_status != "Failed":
            return f"request {r.index}: prefill={r.prefill_status} decode={r.decode_status}; the live bug fails it"
        # Stock Mooncake's status message carries no reason: decode only
        # learns Failed (promptly, not through its waiting timeout).
        if STOCK_NOT_ALIVE not in (r.prefill_failure_reason or ""):
            return f"request {r.index}: prefill reason {r.prefill_failure_reason!r} is not the failed-session one"
        if r.decode_seconds is None or r.decode_seconds > FAILED_WITHIN_S:
            return f"request {r.index}: decode failed after {r.decode_seconds}s, not on prefill's status"
    return None


def _unchecked_state_signature(result) -> Optional[str]:
    """Stock up to 0.5.16, a bad state page: the engine fails that one write, stock's
    worker ignores ``maybe_send_extra``'s result and both sides report Success for
    request 0, whose window state never landed; no session is marked, so the valid
    requests pass. The bad index still reaches the engine, unchecked."""
    bad, good = result.requests[0], result.requests[1:]
    if bad.prefill_status != "Success" or bad.decode_status != "Success":
        return (f"request 0: prefill={bad.prefill_status} decode={bad.decode_status}; stock that ignores the state "
                "send's result reports Success")
    for r in good:
        if not r.ok:
            return f"request {r.index}: not ok; an ignored state failure marks no session"
    return None


# The dropped-write scenario: same stock signature, a different -ext outcome (the
# engine failure is the request's own; only the blacklisting is the bug).
DROPPED_WRITE = BuiltinScenario(
    "dropped write, then 3 good",
    "F6",
    "a valid request whose KV write the engine fails, then 3 valid requests (stock: the session is "
    "blacklisted after that one failure, the valid ones fail 'not alive')",
    _dropped_write,
    passed=lambda result: dropped_write_problem(result) is None,
    signature=_stock_signature,
)

SCENARIOS = [
    BuiltinScenario(
        "bad kv page, then 3 good",
        "F6",
        "a decode KV page outside decode's pool, then 3 valid requests (stock: the session is blacklisted, "
        "the valid ones fail 'not alive')",
        _bad_kv,
        passed=_refused_then_served("bad kv page, then 3 good"),
        signature=_stock_signature,
    ),
    BuiltinScenario(
        "bad swa state page, then 3 good",
        "F6",
        "a decode SWA state page outside its pool, then 3 valid requests (stock: the session is blacklisted; "
        "up to 0.5.16, which ignore the state send's result, Success without that page)",
        _bad_state,
        passed=_refused_then_served("bad swa state page, then 3 good"),
        signature=_stock_signature,
        # Up to 0.5.16 stock serves all four with Success (_unchecked_state_signature): its run
        # gets the long bounds; a loaded CI leg (0.5.12.post1) once sent request 3 in 4.4 s, past
        # STOCK_TIMEOUTS' 4 s waiting timeout.
        stock_reports_success=lambda: not releases.features().stock_mooncake_checks_state_send,
    ),
]
