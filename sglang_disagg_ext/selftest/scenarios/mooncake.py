"""Built-in Mooncake scenarios for F1 and F2: used by the tests and by ``selftest``.

Each scenario says what stock SGLang does with it on each release, so the
differential tests and the selftest table read the same facts:
``stock_expectation(policy)`` is "fail" where the bug is live and "pass" where
the release already has the fix (then stock and ext must both pass).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.scenario import (
    KVPoolSpec,
    RequestSpec,
    Scenario,
    StatePoolSpec,
    StateSpec,
)


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

    def applies(self, policy: releases.ReleasePolicy) -> bool:
        return policy.fixes.get(self.fix) is not releases.FixStatus.NA

    def stock_expectation(self, policy: releases.ReleasePolicy) -> str:
        if not self.applies(policy):
            return "n/a"
        return "fail" if self.plugin_only or policy.is_live(self.fix) else "pass"

    def evaluate(self, result) -> bool:
        return self.passed(result) if self.passed else result.ok


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


def _failed_then_served(result) -> bool:
    """Request 0 Failed on both sides, nothing written outside its pages; request 1 ok."""
    if result.error or len(result.requests) != 2:
        return False
    bad, good = result.requests
    return (
        bad.prefill_status == "Failed"
        and bad.decode_status == "Failed"
        and not any("must be untouched" in m for m in bad.mismatches)
        and good.ok
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


MOONCAKE_SCENARIOS = [
    BuiltinScenario(
        "swa 5 vs 3 pages",
        "F1",
        "prefill has more SWA pages than decode allocated (stock 0.5.10.post1: broadcast error, thread dies)",
        lambda p: _paged_state("swa 5 vs 3 pages", "swa", [3, 5, 7, 9, 11], [2, 4, 6]),
    ),
    BuiltinScenario(
        "swa 3 vs 2 pages",
        "F1",
        "prefill one page longer (stock 0.5.10.post1: IndexError, thread dies)",
        lambda p: _paged_state("swa 3 vs 2 pages", "swa", [1, 2, 3], [10, 12]),
    ),
    BuiltinScenario(
        "nsa 3 vs 5 pages",
        "F1",
        "decode allocated more NSA pages than prefill has (stock 0.5.10.post1: no-op slice, then a broadcast error)",
        # 2 vs N would slip through stock: its page-run grouping diffs both lists
        # and numpy broadcasts a length-1 diff against any length.
        lambda p: _paged_state("nsa 3 vs 5 pages", "nsa", [6, 7, 8], [10, 11, 12, 13, 14]),
    ),
    BuiltinScenario(
        "dsv4 state, 3 pages",
        "F2",
        "a DSv4 state component (stock flat layout returns 0: decode pages stay stale)",
        _dsv4_state,
    ),
]

MOONCAKE_FAILURE_SCENARIO = BuiltinScenario(
    "bad state, then good",
    "F1",
    "an impossible state request ends Failed on both sides; the next request succeeds",
    _failure_then_recovery,
    plugin_only=True,
    passed=_failed_then_served,
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
