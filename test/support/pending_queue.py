"""Two-request scenarios in which decode asks for prefill's parallel info as SGLang's pending queue
does (``Scenario.decode_pending_queue``), for the tests of a prefill decode refuses before any
transfer (F14, F19). Test-only."""

from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, Timeouts


def pending_queue_scenario(name: str, request_s: float, **overrides) -> Scenario:
    """Rooms 1000 and 1001 (KV pages [1, 2] -> [3, 4] and [5] -> [6]; aux rows 1 -> 2, 3 -> 4),
    an 8-page pool, decode's pending-queue lookups; ``overrides`` are further Scenario fields."""
    fields = dict(
        name=name,
        requests=[RequestSpec([1, 2], [3, 4], aux_index=1, dst_aux_index=2),
                  RequestSpec([5], [6], aux_index=3, dst_aux_index=4)],
        kv=KVPoolSpec(num_pages=8),
        timeouts=Timeouts(request_s=request_s, startup_s=30.0, sglang_bootstrap_s=8.0),
        decode_pending_queue=True,
    )
    fields.update(overrides)
    return Scenario(**fields)


def nothing_written(req) -> bool:
    """Whether no page of decode was written for ``req``: the harness lists each of its target pages
    still holding decode's sentinel, and would list a page written anywhere else as "must be untouched"."""
    return bool(req.mismatches) and all("found the sentinel (never written)" in m for m in req.mismatches)
