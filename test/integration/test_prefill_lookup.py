"""F20 on the real Mooncake engine (TCP, 127.0.0.1): a request names a prefill address that never answers.

Two processes through the transfer harness: SGLang's real bootstrap server, managers, senders and
receivers, CPU tensors as pools, a real Mooncake TransferEngine. The harness stands in for decode's
scheduler thread, here for its pending queue (``Scenario.decode_pending_queue``): each request's
receiver is made, then decode asks for its prefill's parallel info as
``DecodePreallocQueue._ensure_prefill_info`` does, once a second, and the harness records how long
each try held that thread. Injection: the first request's bootstrap address is a loopback socket
that listens and never accepts (``RequestSpec.prefill_unanswered``): the kernel takes the
connection, the HTTP query is sent, no answer comes, as behind a link that drops packets. Nothing in
SGLang or the plugin is replaced. The two requests after it go to the real prefill.

Stock: each try holds decode's scheduler thread for the full 5 s of SGLang's HTTP timeout (on a real
decode server no running request gets a token meanwhile: ``test/servers/test_pd_faults.py``); run
with 2 tries here to keep CI short (stock makes 15: about 90 s). ``-ext``: no try holds the thread
longer than a fraction of a second; with stock's 15 tries the request ends Failed (aborted, as
stock aborts it) in about 15 s; the next two requests are served, bytes verified. On sources
carrying ``patches/0.5.23``'s F20 diff (``make test-patched``) stock must do what ``-ext`` does on
the unpatched wheel, and ``-ext`` (which then installs nothing for F20) too.
"""

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import RequestSpec
from support.pending_queue import nothing_written, pending_queue_scenario

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()
# Sources carrying patches/<release>/'s F20 diff: SGLang's own lookup runs off the scheduler thread.
PATCHED = "F20" in POLICY.patched
STOCK_HTTP_TIMEOUT_S = 5.0  # requests.get(url, timeout=5) in every wheel's lookup
EXT_HELD_BOUND_S = 1.0  # -ext waits GRACE_S (0.05 s) at most; the rest is load on a 2-core machine
STOCK_TRIES, TRIES = 2, 15  # stock's pending queue: 15 tries, one a second


def _scenario(tries: int):
    return pending_queue_scenario(
        "a prefill address that never answers", request_s=60, pending_queue_tries=tries,
        requests=[RequestSpec([1, 2], [3, 4], aux_index=1, dst_aux_index=2, prefill_admits=False,
                              prefill_unanswered=True),
                  RequestSpec([5], [6], aux_index=3, dst_aux_index=4),
                  RequestSpec([7], [2], aux_index=5, dst_aux_index=6)])


def _assert_others_served(result):
    stuck, *others = result.requests
    assert stuck.decode_status == "Failed", (stuck.decode_status, stuck.error)
    assert nothing_written(stuck), stuck.mismatches
    for r in others:
        assert r.ok, (r.index, r.prefill_status, r.decode_status, r.mismatches, r.error)
        assert r.decode_failure_reason is None
    assert not [t for r in result.requests for t in r.thread_errors]
    return stuck


def _assert_never_held(result):
    """No try held decode's scheduler thread; the unanswered request Failed after stock's 15 tries."""
    assert result.error is None, result.error
    stuck = _assert_others_served(result)
    assert len(stuck.lookup_seconds) == TRIES, stuck.lookup_seconds
    assert max(stuck.lookup_seconds) < EXT_HELD_BOUND_S, stuck.lookup_seconds
    # Stock's 15 tries a second apart, then the abort: Failed in about 15 s, not 15 x 6 s.
    assert stuck.decode_seconds < TRIES + 10, stuck.decode_seconds
    held = [s for r in result.requests[1:] for s in r.lookup_seconds]
    assert held and max(held) < EXT_HELD_BOUND_S, held


@pytest.mark.timeout(180)
def test_stock_holds_decodes_scheduler_for_each_try():
    if PATCHED:
        _assert_never_held(run_scenario(_scenario(TRIES), "mooncake", timeout_s=150))
        return
    result = run_scenario(_scenario(STOCK_TRIES), "mooncake", timeout_s=150)
    assert result.error is None, result.error
    stuck = _assert_others_served(result)
    assert len(stuck.lookup_seconds) == STOCK_TRIES, stuck.lookup_seconds
    assert all(s >= STOCK_HTTP_TIMEOUT_S - 0.1 for s in stuck.lookup_seconds), stuck.lookup_seconds


@pytest.mark.timeout(180)
@pytest.mark.skipif(not (POLICY.is_live("F20") or PATCHED),
                    reason=f"F20 is {POLICY.fixes['F20'].value} on SGLang {POLICY.version}")
def test_ext_never_holds_decodes_scheduler_and_ends_the_request():
    _assert_never_held(run_scenario(_scenario(TRIES), "mooncake-ext", timeout_s=150))
