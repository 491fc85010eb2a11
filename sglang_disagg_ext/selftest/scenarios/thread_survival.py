"""F8 scenarios: an unexpected exception on a Mooncake transfer-path thread.

Each needs a fault injected in the prefill process (``prefill_hook``: a
function in ``test/support/prefill_faults.py``, loaded through the harness's
``SGLANG_HARNESS_PREFILL_HOOK``): nothing a well-formed request does makes
stock raise there on every release. Request 0 (room 1000) meets the fault,
request 1 (room 1001) is a plain KV request behind it.

Stock (every release): the thread dies; request 0 and request 1 end on decode
only through SGLang's waiting timeout. Ext: request 0 ends Failed on both sides
well under the timeouts with the injected exception in the prefill reason,
request 1 succeeds, byte-verified.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario
from sglang_disagg_ext.selftest.scenarios.mooncake import (
    FAILED_WITHIN_S,
    STOCK_TIMEOUTS,
    BuiltinScenario,
    _decode_waited_out,
)

FAULT_TEXT = "injected fault"


@dataclasses.dataclass(frozen=True)
class ThreadFaultScenario(BuiltinScenario):
    # ``test/support/prefill_faults.py`` function to load as the prefill hook.
    prefill_hook: str = ""


def _two_requests(name: str) -> Scenario:
    """Room 1000: KV 1-3 -> 6-8, aux 1 -> 2; room 1001: KV 4-5 -> 9-10, aux 3 -> 4."""
    return Scenario(
        name=name,
        requests=[
            RequestSpec(src_kv_pages=[1, 2, 3], dst_kv_pages=[6, 7, 8], aux_index=1, dst_aux_index=2),
            RequestSpec(src_kv_pages=[4, 5], dst_kv_pages=[9, 10], aux_index=3, dst_aux_index=4),
        ],
        kv=KVPoolSpec(num_pages=12),
    )


def _prefill_thread_died(r, thread: str) -> Optional[str]:
    """None if a prefill thread whose target is ``thread`` died of the injected fault."""
    died = [t for t in r.thread_errors if t.startswith("prefill ") and f"({thread})" in t]
    if not died:
        return f"request {r.index}: no prefill {thread} thread death (thread_errors: {r.thread_errors})"
    if not any(FAULT_TEXT in t for t in died):
        return f"request {r.index}: prefill {thread} thread died of something else: {died}"
    return None


def _both_waited_out(thread: str):
    """Stock: ``thread`` died of the injected fault on request 0; both requests end on
    decode only through SGLang's waiting timeout (nothing told it)."""

    def check(result, policy) -> Optional[str]:
        bad, good = result.requests
        return (
            _prefill_thread_died(bad, thread)
            or _decode_waited_out(bad, STOCK_TIMEOUTS.sglang_waiting_s)
            or _decode_waited_out(good, STOCK_TIMEOUTS.sglang_waiting_s)
        )

    return check


def _failed_with_fault_then_served(result) -> bool:
    """Request 0 Failed on both sides, prefill's reason naming the injected fault, decode's
    well under SGLang's timeouts, nothing written outside its pages; no thread died;
    request 1 ok (byte-verified).

    Prefill's own time is bounded only where it got to ``send`` (the bootstrap fault
    ends the room before): there decode's Failed, which only prefill's sync can
    bring that early, bounds it.
    """
    if result.error or len(result.requests) != 2:
        return False
    bad, good = result.requests
    return (
        bad.prefill_status == "Failed"
        and FAULT_TEXT in (bad.prefill_failure_reason or "")
        and bad.decode_status == "Failed"
        and bool(bad.decode_failure_reason)
        and bad.decode_seconds is not None
        and bad.decode_seconds <= FAILED_WITHIN_S
        and (bad.prefill_seconds is None or bad.prefill_seconds <= FAILED_WITHIN_S)
        and not any("must be untouched" in m for m in bad.mismatches)
        and not any(r.thread_errors for r in result.requests)
        and good.ok
    )


def _thread_fault(name: str, description: str, thread: str, hook: str) -> ThreadFaultScenario:
    """Two requests; ``hook`` makes prefill's ``thread`` raise on the first (see the module docstring)."""
    return ThreadFaultScenario(
        name, "F8", description, lambda p: _two_requests(name),
        passed=_failed_with_fault_then_served, signature=_both_waited_out(thread), prefill_hook=hook,
    )


SCENARIOS = [
    _thread_fault(
        "transfer worker raises, then a good request",
        "send_aux raises on the transfer worker for one room (stock: the thread dies, later rooms time out)",
        "transfer_worker", "raise_in_send_aux",
    ),
    _thread_fault(
        "bootstrap handler raises, then a good request",
        "prefill's bootstrap thread raises handling one room's message (stock: the thread dies, later rooms time out)",
        "bootstrap_thread", "raise_on_waiting_for_input",
    ),
]
