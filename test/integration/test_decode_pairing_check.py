"""F14 on the real Mooncake engine (TCP, 127.0.0.1): a decode started with another page size than its prefill.

Two processes through the transfer harness: SGLang's real bootstrap server, managers, senders and
receivers, CPU tensors as pools, a real Mooncake TransferEngine. The harness stands in for decode's
scheduler, here for its pending queue (``Scenario.decode_pending_queue``): each request's receiver is
made, then decode asks for prefill's parallel info as ``DecodePreallocQueue._ensure_prefill_info``
does. Injection: decode runs with ``--page-size`` 8 (its server arguments and pools,
``Scenario.decode_page_size``) where prefill runs 4; nothing in SGLang or the plugin is replaced.

Stock: SGLang's pairing check (``CommonKVManager.try_ensure_parallel_info``) raises
``RuntimeError: Page size mismatch: prefill server has page_size=4, but decode server has
page_size=8`` into its caller, decode's scheduler loop, which has no handler: a decode server exits
with every request it serves (shown with real servers on 0.5.23, ``test/servers/test_pd_faults.py``).
The harness records the raise for each request. ``-ext``: both requests end Failed on decode at once
with that message as the reason, one ERROR for the prefill, no page of decode written, no raise.
On sources carrying ``patches/0.5.23``'s F14 diff (``make test-patched``) stock must do what ``-ext``
does on the unpatched wheel, and ``-ext`` (which then installs nothing for F14) too.
"""

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from support.pending_queue import nothing_written, pending_queue_scenario

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()
# Sources carrying patches/<release>/'s F14 diff: SGLang's own lookup refuses the prefill.
PATCHED = "F14" in POLICY.patched
MISMATCH = "Page size mismatch: prefill server has page_size=4, but decode server has page_size=8"
EXT_BOUND_S = 5.0  # the refusal is made at the first try (one HTTP query); the rest is load


def _scenario():
    return pending_queue_scenario("decode with another page size", request_s=30, page_size=4, decode_page_size=8)


def _assert_refused(result, told: bool):
    """Both requests Failed on decode at once with the mismatch as the reason, one ERROR, nothing written;
    ``told``: prefill ended both too, told by decode (``-ext``'s notice), not by its bootstrap timeout."""
    assert result.error is None, result.error
    reqs = result.requests
    assert [r.error for r in reqs] == [None, None], [r.error for r in reqs]
    assert [r.decode_status for r in reqs] == ["Failed", "Failed"], [(r.decode_status, r.decode_failure_reason) for r in reqs]
    for r in reqs:
        assert r.decode_seconds < EXT_BOUND_S, (r.decode_seconds, r.decode_failure_reason)
        assert "cannot pair with this decode, its requests are refused" in r.decode_failure_reason
        assert MISMATCH in r.decode_failure_reason, r.decode_failure_reason
        assert nothing_written(r), r.mismatches
        assert not r.thread_errors, r.thread_errors
    errors = [line for r in reqs for line in r.decode_log if line.startswith("ERROR")]
    assert len(errors) == 1 and MISMATCH in errors[0], errors
    if told:
        assert [r.prefill_status for r in reqs] == ["Failed", "Failed"], [r.prefill_status for r in reqs]
        assert not any("timed out" in (r.prefill_failure_reason or "") for r in reqs), \
            [r.prefill_failure_reason for r in reqs]


@pytest.mark.timeout(180)
def test_stock_raises_the_mismatch_into_decodes_scheduler():
    result = run_scenario(_scenario(), "mooncake", timeout_s=150)
    if PATCHED:
        _assert_refused(result, told=False)  # the F14 diff fails decode's rooms; it does not tell prefill
        return
    assert result.error is None, result.error
    for r in result.requests:
        assert r.error is not None and f"RuntimeError: {MISMATCH}" in r.error, (r.decode_status, r.error)
        assert "try_ensure_parallel_info" in r.error, r.error


@pytest.mark.timeout(180)
@pytest.mark.skipif(not (POLICY.is_live("F14") or PATCHED),
                    reason=f"F14 is {POLICY.fixes['F14'].value} on SGLang {POLICY.version}")
def test_ext_refuses_the_prefill_and_decode_serves_on():
    # -ext tells a prefill that takes ABORT (0.5.22 on); on patched sources it installs nothing for F14.
    _assert_refused(run_scenario(_scenario(), "mooncake-ext", timeout_s=150),
                    told=releases.prefill_takes_abort() and not PATCHED)
