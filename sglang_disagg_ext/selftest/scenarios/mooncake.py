"""Built-in Mooncake scenarios for F1 and F2: used by the tests and by ``selftest``.

Each scenario says what stock SGLang does with it on each release, so the
differential tests and the selftest table read the same facts:
``stock_expectation(policy)`` is "fail" where the bug is live and "pass" where
the release already has the fix (then stock and ext must both pass).

``stock_signature(result, policy)`` says whether a stock run failed *the way
the live bug fails* (None) or why it is not a reproduction of it (a reason):
a setup error, a harness error, a harness deadline or a side that never
reached a final state is never counted as the bug, nor is a failure of any
other shape. The shapes were read from stock runs of each release (see each
scenario's signature function).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.scenario import (
    KVPoolSpec,
    RequestSpec,
    Scenario,
    StatePoolSpec,
    StateSpec,
    Timeouts,
)

# Every "failed, then served" request must reach Failed on both sides well
# under SGLang's own timeouts (the harness shortens them to these values);
# a side that only ended through SGLang's waiting or bootstrap timeout did
# not propagate the failure, it waited it out.
_DEFAULT_TIMEOUTS = Timeouts()
FAILED_WITHIN_S = min(_DEFAULT_TIMEOUTS.sglang_waiting_s, _DEFAULT_TIMEOUTS.sglang_bootstrap_s) / 2
# Stock runs of a live bug that hangs end only through SGLang's waiting timeout,
# once per request; a shorter one there keeps each differential row seconds
# shorter. Ext runs keep the default, so an ext failure (within FAILED_WITHIN_S)
# is never mistaken for a wait-out.
STOCK_TIMEOUTS = dataclasses.replace(_DEFAULT_TIMEOUTS, sglang_waiting_s=4.0)
# Stock runs of a bug that stock serves with Success (wrong bytes, no error): the
# bound is never waited out when the bug shows, so it costs nothing to make it
# long. An idle machine lands such a request in well under 1 s, but a loaded CI
# machine (0.5.23, -n 4) took 4.4 s once, past STOCK_TIMEOUTS, and the row read
# as "stock did not show the bug".
STOCK_SERVES_TIMEOUTS = dataclasses.replace(_DEFAULT_TIMEOUTS, sglang_waiting_s=20.0, sglang_bootstrap_s=20.0)


@dataclasses.dataclass(frozen=True)
class BuiltinScenario:
    name: str
    fix: str
    description: str
    build: Callable[[releases.ReleasePolicy], Scenario]
    # True for behaviour only the plugin has (stock fails on every release),
    # False for a fix that is upstream on some releases.
    plugin_only: bool = False
    passed: Callable = None  # (ScenarioResult) -> bool; default: every request ok
    # (ScenarioResult, ReleasePolicy) -> None if the result is exactly the live
    # bug's failure on that release, else a reason; called after the checks
    # every scenario shares (``not_a_stock_run_failure``).
    signature: Callable = None
    # () -> bool: whether the installed SGLang can build the scenario at all (a
    # constructor argument it is made from, say); None: every release can.
    buildable: Callable = None
    # () -> bool: True where stock serves the live bug with Success on both sides on the
    # installed release (its signature requires that): its stock run gets
    # STOCK_SERVES_TIMEOUTS instead of STOCK_TIMEOUTS. None: stock waits it out.
    stock_reports_success: Callable = None

    def applies(self, policy: releases.ReleasePolicy) -> bool:
        # Not where the code path is absent (n/a), nor where the bug is live but this
        # plugin version has no adapter for the release (uncovered: -ext is stock there),
        # nor where SGLang cannot build what the scenario is made of.
        if self.buildable is not None and not self.buildable():
            return False
        return policy.fixes.get(self.fix) in (releases.FixStatus.LIVE, releases.FixStatus.UPSTREAM)

    def stock_expectation(self, policy: releases.ReleasePolicy) -> str:
        if not self.applies(policy):
            return "n/a"
        return "fail" if self.plugin_only or policy.is_live(self.fix) else "pass"

    def scenario_for(self, policy: releases.ReleasePolicy, backend: str) -> Scenario:
        """The scenario to run on ``backend``: where the scenario keeps the default bounds,
        stock backends get ``STOCK_TIMEOUTS`` (a wait-out, which the signatures below
        expect) or, for a bug stock serves with Success, ``STOCK_SERVES_TIMEOUTS``."""
        scenario = self.build(policy)
        if not backend.endswith("-ext") and scenario.timeouts == _DEFAULT_TIMEOUTS:
            serves = self.stock_reports_success is not None and self.stock_reports_success()
            stock = STOCK_SERVES_TIMEOUTS if serves else STOCK_TIMEOUTS
            scenario = dataclasses.replace(scenario, timeouts=stock)
        return scenario

    def evaluate(self, result) -> bool:
        return self.passed(result) if self.passed else result.ok

    def stock_signature(self, result, policy: releases.ReleasePolicy) -> Optional[str]:
        """None when the stock ``result`` shows exactly this scenario's live bug on ``policy``'s
        release; otherwise why it does not (so it must not count as a reproduction)."""
        if self.stock_expectation(policy) != "fail":
            return f"stock is not expected to fail {self.name!r} on SGLang {policy.version}"
        reason = not_a_stock_run_failure(result, len(self.build(policy).requests))
        if reason:
            return reason
        if self.signature is None:
            return f"{self.name!r} has no stock failure signature"
        return self.signature(result, policy)


def _paged_state(name: str, kind: str, src: List[int], dst: List[int]) -> Scenario:
    """KV pages 1-4 -> 5-8, aux row 2 -> 5, one paged state component."""
    return Scenario(
        name=name,
        requests=[
            RequestSpec(
                src_kv_pages=[1, 2, 3, 4],
                dst_kv_pages=[5, 6, 7, 8],
                aux_index=2,
                dst_aux_index=5,
                state=[StateSpec(kind, src, dst)],
            )
        ],
        kv=KVPoolSpec(num_pages=10),
        state_pools=[StatePoolSpec(kind=kind, num_pages=16)],
    )


def _dsv4_state(policy: releases.ReleasePolicy) -> Scenario:
    # No release has a "dsv4" StateType: 0.5.12+ register DeepSeek-V4's pool as
    # an SWA component. The flat layout carries the string itself (as upstream
    # main did between PR #23882 and #24888), which stock drops silently.
    kind = "dsv4" if policy.layout is releases.StateLayout.FLAT else "swa"
    return _paged_state("dsv4 state, 3 pages", kind, [2, 3, 4], [9, 10, 11])


def refused_request_problem(r, want: str, decode_want: Optional[str] = None) -> Optional[str]:
    """None when request ``r`` was refused before the engine the -ext way: Failed on both
    sides within ``FAILED_WITHIN_S``, both reasons saying ``want`` (decode's saying
    ``decode_want`` where given: a stock decode that is sent no reason), every page and row
    it targets still holding the sentinel and nothing else written, no thread error."""
    if not r.failed_within(FAILED_WITHIN_S):
        return (f"request {r.index}: not Failed on both sides within {FAILED_WITHIN_S}s "
                f"(prefill={r.prefill_status} {r.prefill_seconds}, decode={r.decode_status} {r.decode_seconds})")
    for side, reason, text in (("prefill", r.prefill_failure_reason, want),
                               ("decode", r.decode_failure_reason, decode_want or want)):
        if text not in (reason or ""):
            return f"request {r.index}: {side} reason {reason!r} does not say {text!r}"
    # The verifier expected prefill's bytes on the targeted pages: a refused
    # request leaves exactly those reporting the sentinel.
    stray = [m for m in r.mismatches if "found the sentinel" not in m]
    if stray or not r.mismatches:
        return f"request {r.index}: decode written by a refused request: {stray or 'no expected page reported'}"
    if r.thread_errors:
        return f"request {r.index}: thread errors {r.thread_errors}"
    return None


def _failed_then_served(result) -> bool:
    """Request 0 Failed on both sides with a reason, well under SGLang's timeouts, nothing
    written outside its pages; request 1 ok."""
    if result.error or len(result.requests) != 2:
        return False
    bad, good = result.requests
    return bad.failed_within(FAILED_WITHIN_S) and not any("must be untouched" in m for m in bad.mismatches) and good.ok


# -- stock failure signatures ---------------------------------------------------------

_FINAL = ("Success", "Failed")


def not_a_stock_run_failure(result, n_requests: int) -> Optional[str]:
    """Why ``result`` cannot be a stock reproduction of any bug, whatever its shape (None if it can).

    A setup error (engine, pools, imports), a harness error, the harness
    deadline or a worker crash all set ``result.error``; a request missing
    from the result or whose decode side never reached a final state within
    the harness's own bound is the rig's failure, not SGLang's.
    """
    if result.error:
        kind = "setup failure" if result.setup_failed else (
            "harness deadline" if "deadline" in result.error else "harness/worker error")
        return f"{kind}: {result.error}"
    if len(result.requests) != n_requests:
        return f"{len(result.requests)} request results, the scenario has {n_requests}"
    for r in result.requests:
        if r.error:
            return f"request {r.index}: worker error: {r.error.strip().splitlines()[-1] if r.error.strip() else r.error}"
        if r.decode_status not in _FINAL:
            return f"request {r.index}: decode ended in {r.decode_status} at the harness bound, not a final state"
    return None


def _only_state_sentinel(r, kind: str, src: List[int], dst: List[int]) -> Optional[str]:
    """None if the mismatches of ``r`` are exactly: every decode page of state component 0
    (``kind``; one layer, so a K and a V buffer) still holding the sentinel where prefill
    page ``src[i]`` must have landed on ``dst[i]``; nothing else wrong."""
    want = {
        f"state0:{kind} buffer {b} page {d}: expected prefill page {s}'s bytes, found the sentinel"
        for b in (0, 1)
        for s, d in zip(src, dst)
    }
    got = {m.split(" (never written)")[0] for m in r.mismatches}
    if got != want:
        return f"mismatches are not exactly the {len(want)} state pages holding the sentinel: {r.mismatches[:8]}"
    return None


def _dsv4_signature(result, policy) -> Optional[str]:
    """F2 (flat layout): both sides Success, KV and aux verified, the 3 DSv4 pages
    (decode 9, 10, 11) never written: they still hold the sentinel."""
    r = result.requests[0]
    if r.prefill_status != "Success" or r.decode_status != "Success":
        return f"F2 reports Success on both sides; got prefill={r.prefill_status} decode={r.decode_status}"
    if r.thread_errors:
        return f"F2 raises nothing; got {r.thread_errors}"
    kind = "dsv4" if policy.layout is releases.StateLayout.FLAT else "swa"
    return _only_state_sentinel(r, kind, [2, 3, 4], [9, 10, 11])


def _thread_died(r, needles, side: str = "prefill") -> Optional[str]:
    """None if ``side``'s transfer thread died with an exception naming one of ``needles``."""
    died = [t for t in r.thread_errors if t.startswith(f"{side} ") and "transfer_worker" in t]
    if not died:
        return f"request {r.index}: no {side} transfer-thread exception (thread_errors: {r.thread_errors})"
    if not any(n in t for t in died for n in needles):
        return f"request {r.index}: {side} transfer thread died of something else: {died} (expected one of {needles})"
    return None


def _decode_waited_out(r, waiting_s: float) -> Optional[str]:
    """None if decode ended Failed only through SGLang's own waiting timeout (the live bug:
    nothing told it)."""
    if r.decode_status != "Failed":
        return f"request {r.index}: decode {r.decode_status}, the live bug ends decode Failed"
    if "timed out" not in (r.decode_failure_reason or ""):
        return f"request {r.index}: decode failed for another reason: {r.decode_failure_reason!r}"
    if r.decode_seconds is None or r.decode_seconds < waiting_s - 0.5:
        return f"request {r.index}: decode failed after {r.decode_seconds}s, before SGLang's {waiting_s}s waiting timeout"
    return None


def _f1_signature(needles):
    """F1 (0.5.10.post1): the prefill transfer thread dies with ``needles`` on the length
    mismatch, prefill never reaches a final state, decode waits until its timeout."""

    def check(result, policy) -> Optional[str]:
        r = result.requests[0]
        return (
            _thread_died(r, needles)
            or (None if r.prefill_status not in _FINAL else f"prefill reached {r.prefill_status}; its thread died")
            or _decode_waited_out(r, STOCK_TIMEOUTS.sglang_waiting_s)
        )

    return check


def _failure_path_signature(result, policy) -> Optional[str]:
    """Stock on the impossible Mamba request: the prefill transfer thread dies on Mamba's
    single-slot assertion ("Mamba should have single state index") and takes every later
    request with it: both requests end on decode only through the waiting timeout."""
    bad, good = result.requests
    return (
        _thread_died(bad, ("Mamba should have single state index",))
        or _decode_waited_out(bad, STOCK_TIMEOUTS.sglang_waiting_s)
        or _decode_waited_out(good, STOCK_TIMEOUTS.sglang_waiting_s)
    )


def _two_components(policy: releases.ReleasePolicy) -> Scenario:
    """A Mamba slot and SWA pages in one request (per-component layout only)."""
    return Scenario(
        name="mamba+swa, 5 vs 3 SWA pages",
        requests=[
            RequestSpec(
                src_kv_pages=[1, 2, 3],
                dst_kv_pages=[6, 7, 8],
                aux_index=1,
                dst_aux_index=4,
                state=[StateSpec("mamba", [3], [9]), StateSpec("swa", [2, 4, 6, 8, 10], [1, 5, 7])],
            )
        ],
        kv=KVPoolSpec(num_pages=10),
        state_pools=[StatePoolSpec(kind="mamba", num_pages=12), StatePoolSpec(kind="swa", num_pages=16)],
    )


def _failure_then_recovery(policy: releases.ReleasePolicy) -> Scenario:
    """Request 0 asks for two Mamba slots (impossible), request 1 is good.

    Stock asserts inside the transfer thread (0.5.10.post1 / 0.5.11 kill the
    thread; decode waits for its timeout). Ext must end request 0 as Failed on
    both sides and serve request 1.
    """
    bad = RequestSpec(
        src_kv_pages=[1, 2],
        dst_kv_pages=[5, 6],
        aux_index=1,
        dst_aux_index=1,
        state=[StateSpec("mamba", [2, 3], [4])],
    )
    good = RequestSpec(
        src_kv_pages=[3, 4],
        dst_kv_pages=[7, 8],
        aux_index=2,
        dst_aux_index=2,
        state=[StateSpec("mamba", [5], [6])],
    )
    return Scenario(
        name="bad mamba state, then a good request",
        requests=[bad, good],
        kv=KVPoolSpec(num_pages=10),
        state_pools=[StatePoolSpec(kind="mamba", num_pages=8)],
    )


# What stock 0.5.10.post1's prefill transfer thread dies of, per F1 scenario (read from
# stock runs; SGLang wraps it as "RuntimeError: Transfer thread failed because of <message>").
# Its page-run grouping diffs each page list (np.diff): N pages give N - 1 differences.
F1_THREAD_ERRORS = {
    # 5 prefill pages -> 4 diffs, 3 decode pages -> 2 diffs
    "swa 5 vs 3 pages": ("operands could not be broadcast together with shapes (4,) (2,)",),
    # the third prefill page has no decode page: IndexError
    "swa 3 vs 2 pages": ("list index out of range",),
    # 3 prefill pages -> 2 diffs, 5 decode pages -> 4 diffs
    "nsa 3 vs 5 pages": ("operands could not be broadcast together with shapes (2,) (4,)",),
}

MOONCAKE_SCENARIOS = [
    BuiltinScenario(
        "swa 5 vs 3 pages",
        "F1",
        "prefill has more SWA pages than decode allocated (stock 0.5.10.post1: broadcast error, thread dies)",
        lambda p: _paged_state("swa 5 vs 3 pages", "swa", [3, 5, 7, 9, 11], [2, 4, 6]),
        signature=_f1_signature(F1_THREAD_ERRORS["swa 5 vs 3 pages"]),
    ),
    BuiltinScenario(
        "swa 3 vs 2 pages",
        "F1",
        "prefill one page longer (stock 0.5.10.post1: IndexError, thread dies)",
        lambda p: _paged_state("swa 3 vs 2 pages", "swa", [1, 2, 3], [10, 12]),
        signature=_f1_signature(F1_THREAD_ERRORS["swa 3 vs 2 pages"]),
    ),
    BuiltinScenario(
        "nsa 3 vs 5 pages",
        "F1",
        "decode allocated more NSA pages than prefill has (stock 0.5.10.post1: no-op slice, then a broadcast error)",
        # 2 vs N would slip through stock: its page-run grouping diffs both lists
        # and numpy broadcasts a length-1 diff against any length.
        lambda p: _paged_state("nsa 3 vs 5 pages", "nsa", [6, 7, 8], [10, 11, 12, 13, 14]),
        signature=_f1_signature(F1_THREAD_ERRORS["nsa 3 vs 5 pages"]),
    ),
    BuiltinScenario(
        "dsv4 state, 3 pages",
        "F2",
        "a DSv4 state component (stock flat layout returns 0: decode pages stay stale)",
        _dsv4_state,
        signature=_dsv4_signature,
        stock_reports_success=lambda: True,
    ),
]

MOONCAKE_FAILURE_SCENARIO = BuiltinScenario(
    "bad state, then good",
    "F1",
    "an impossible state request ends Failed on both sides; the next request succeeds",
    _failure_then_recovery,
    plugin_only=True,
    passed=_failed_then_served,
    signature=_failure_path_signature,
)

MOONCAKE_PER_COMPONENT_SCENARIO = BuiltinScenario(
    "mamba+swa, 5 vs 3 SWA pages",
    "F1",
    "two components of different types in one request (per-component layout)",
    _two_components,
)


def scenarios_for(policy: releases.ReleasePolicy) -> List[BuiltinScenario]:
    """The scenarios that make sense on this release's state layout."""
    out = [s for s in MOONCAKE_SCENARIOS if s.applies(policy)]
    if policy.layout is releases.StateLayout.PER_COMPONENT:
        out.append(MOONCAKE_PER_COMPONENT_SCENARIO)
    out.append(MOONCAKE_FAILURE_SCENARIO)
    return out
