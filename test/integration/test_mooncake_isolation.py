"""F6 on the real Mooncake engine (TCP, 127.0.0.1): one bad request never poisons the decode session.

Each scenario (``selftest.scenarios.isolation``) is a request with one decode
index outside decode's pool, then three valid requests to the same decode,
through the transfer harness: two processes, SGLang's real bootstrap server,
managers, senders and receivers, CPU tensors as pools, a real Mooncake
TransferEngine; decode checks every destination page byte for byte and that
every other page still holds its sentinel.

Injection: the out-of-pool index is the request's own decode page list
(``RequestSpec(allow_out_of_pool=True)``), handed by the harness's decode to
SGLang's real ``send_metadata``: the narrowest boundary, nothing replaced.

On sources carrying patches/0.5.23's F6 diff (`make test-patched`) the -ext vs
stock tests skip ("n/a"): there ``mooncake-ext`` adds nothing to the patched code, and the patched test
below runs SGLang's own ``mooncake`` through the same scenarios instead.
"""

import os
import signal

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, Timeouts
from sglang_disagg_ext.selftest.scenarios.isolation import (
    DROPPED_WRITE,
    REFUSALS,
    SCENARIOS,
    dropped_write_problem,
    refusal_problem,
)
from support import plugin_metrics

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()
LIVE = POLICY.is_live("F6")
PATCHED = "F6" in POLICY.patched
live_only = pytest.mark.skipif(
    not LIVE,
    reason=("n/a: these sources carry patches/'s F6 diff; the patched test below runs instead" if PATCHED
            else f"F6 is not live on SGLang {POLICY.version}"),
)
# patches/0.5.23's F6 diff: SGLang's own reasons, written out by hand from each scenario's
# numbers (the plugin's wording, after "decode session <id>: "). Stock Mooncake's status
# message carries no reason, so a stock decode records its own generic one.
PATCHED_REFUSALS = {
    "bad kv page, then 3 good":
        "kv: destination index 40 (position 1 of 2) outside decode's pool of 12 pages (valid 0..11)",
    "bad swa state page, then 3 good":
        "state component 0 (swa): destination index 8 (position 2 of 3) outside decode's pool of 8 entries "
        "(valid 0..7)",
}
STOCK_DECODE_FAILED = "Failed to get kvcache from prefill instance, it might be dead"
PATCHED_REFUSED_LINE = "refused before transfer: decode session "
PATCHED_PROBE_LINE = "failed, but the peer answers a probe: only that request is failed, the session is kept"
NO_SIZES_LINE = "published no pool sizes (a stock decode): destination index checks are off"


@live_only
@pytest.mark.timeout(400)
@pytest.mark.parametrize("builtin", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_bad_request_then_three_good(builtin):
    """Stock: the bad request fails in the engine and the three valid ones after it fail
    with the blacklisted-session reason ("... is not alive"). Ext: the bad one is Failed on
    both sides within the bound with the reason (component, index, pool size), nothing of
    it written, and the three valid ones pass byte for byte."""
    stock = run_scenario(builtin.scenario_for(POLICY, "mooncake"), "mooncake")
    why = builtin.stock_signature(stock, POLICY)
    assert why is None, f"stock did not fail the live bug's way: {why}\n{stock.describe()}"

    ext = run_scenario(builtin.build(POLICY), "mooncake-ext")
    problem = refusal_problem(ext, REFUSALS[builtin.name])
    assert problem is None, f"{problem}\n{ext.describe()}"
    assert builtin.evaluate(ext)
    # The refusal is prefill's, before the engine: its log names it, and no
    # session was marked failed.
    bad_log = ext.requests[0].prefill_log
    assert any("refused before transfer" in x and REFUSALS[builtin.name] in x for x in bad_log), bad_log
    assert not any("failed." in x and "Session" in x for r in ext.requests for x in r.prefill_log)


@live_only
@pytest.mark.timeout(400)
def test_dropped_write_fails_its_request_only():
    """A valid request whose one KV write the engine fails (the harness's dropped-write
    fault on prefill's engine object, ``harness.faults``: the narrowest boundary, the
    engine itself is real). Stock: that request fails and the session is blacklisted,
    so the three valid requests after it fail "not alive". Ext: that request is Failed
    on both sides with stock's engine-failure reason, prefill probes decode, finds it
    alive and keeps the session (log + metric): the three valid requests pass byte for byte."""
    stock = run_scenario(DROPPED_WRITE.scenario_for(POLICY, "mooncake"), "mooncake")
    why = DROPPED_WRITE.stock_signature(stock, POLICY)
    assert why is None, f"stock did not fail the live bug's way: {why}\n{stock.describe()}"
    assert stock.dropped_writes and stock.dropped_writes["engine_calls_failed"] >= 1, stock.dropped_writes

    ext = run_scenario(DROPPED_WRITE.build(POLICY), "mooncake-ext")
    problem = dropped_write_problem(ext)
    assert problem is None, f"{problem}\n{ext.describe()}"
    assert ext.dropped_writes["engine_calls_failed"] >= 1, ext.dropped_writes
    assert plugin_metrics.value(ext.plugin_metrics["prefill"], "sglang_disagg_ext_session_probes_total",
                                fix="F6", result="alive") == 1.0, \
        ext.plugin_metrics
    assert not any("marked failed" in x for r in ext.requests for x in r.prefill_log)


@live_only
@pytest.mark.timeout(400)
def test_stock_decode_peer_keeps_stock_behaviour_and_says_so_once():
    """Ext prefill, stock decode (no pool sizes published): one INFO line at registration,
    and the bad request reaches the engine as in stock and fails there. The session is
    not blacklisted: prefill probes decode after that failure, finds it alive, and the
    three valid requests after it succeed on both sides. (Their bytes are not asserted:
    with no sizes to check, the bad index's write can land in another registered buffer,
    as stock's does.)"""
    builtin = SCENARIOS[0]
    result = run_scenario(builtin.build(POLICY), "mooncake-ext", decode_backend="mooncake")
    lines = [x for x in result.plugin_log["prefill"] if NO_SIZES_LINE in x]
    assert len(lines) == 1, result.plugin_log["prefill"]
    assert result.requests[0].prefill_status == "Failed", result.describe()
    assert "Failed to send kv chunk" in (result.requests[0].prefill_failure_reason or ""), result.describe()
    for r in result.requests[1:]:
        assert r.success, result.describe()
    assert plugin_metrics.value(result.plugin_metrics["prefill"], "sglang_disagg_ext_session_probes_total",
                                fix="F6", result="alive") == 1.0, \
        result.plugin_metrics


@live_only
@pytest.mark.timeout(400)
def test_stock_prefill_ignores_the_extra_registration_frame():
    """Stock prefill, ext decode: the trailing pool-sizes frame is ignored by stock's parser;
    valid requests transfer byte for byte."""
    scn = Scenario(
        name="ext decode, stock prefill",
        requests=[RequestSpec([1, 2], [3, 4], aux_index=1, dst_aux_index=2), RequestSpec([5], [6], aux_index=3)],
        kv=KVPoolSpec(num_pages=8),
    )
    result = run_scenario(scn, "mooncake", decode_backend="mooncake-ext")
    assert result.decode_manager.startswith("sglang_disagg_ext."), result.describe()
    assert result.prefill_manager.startswith("sglang.srt.disaggregation.mooncake.conn."), result.describe()
    assert result.ok, result.describe()


@pytest.mark.skipif(not PATCHED, reason="n/a: these SGLang sources do not carry patches/'s F6 diff")
@pytest.mark.timeout(400)
@pytest.mark.parametrize("builtin", SCENARIOS + [DROPPED_WRITE], ids=[s.name for s in SCENARIOS + [DROPPED_WRITE]])
def test_patched_sglang_fails_the_bad_request_and_serves_the_rest(builtin):
    """patches/<release>/'s F6 diff in SGLang's own Mooncake manager (`make test-patched`): stock
    does what -ext does on the unpatched wheel. Out-of-pool index: request 0 Failed on both sides
    within the bound, prefill's reason naming the component, the index and the pool size (decode's
    stock's generic one), nothing of it written, no session marked failed. Dropped write: request 0
    Failed with stock's engine-failure reason, prefill probes decode, finds it alive and keeps the
    session. Either way the three valid requests after it pass byte for byte. The unpatched wheel's
    stock runs of the same scenarios fail them (the tests above)."""
    stock = run_scenario(builtin.build(POLICY), "mooncake")  # -ext's bounds: stock must pass here
    assert stock.prefill_manager.startswith("sglang.srt.disaggregation.mooncake.conn."), stock.describe()
    no_session_marked = not any("failed." in x and "Session" in x for r in stock.requests for x in r.prefill_log)
    if builtin is DROPPED_WRITE:
        problem = dropped_write_problem(stock)
        assert problem is None, f"{problem}\n{stock.describe()}"
        assert stock.dropped_writes["engine_calls_failed"] >= 1, stock.dropped_writes
        assert any(PATCHED_PROBE_LINE in x for x in stock.requests[0].prefill_log), stock.requests[0].prefill_log
        assert no_session_marked, stock.describe()
        return
    want = PATCHED_REFUSALS[builtin.name]
    problem = refusal_problem(stock, want, STOCK_DECODE_FAILED)
    assert problem is None, f"{problem}\n{stock.describe()}"
    assert want in stock.requests[0].prefill_failure_reason and "decode session " in \
        stock.requests[0].prefill_failure_reason, stock.describe()
    bad_log = stock.requests[0].prefill_log
    assert any(PATCHED_REFUSED_LINE in x and want in x for x in bad_log), bad_log
    assert no_session_marked, stock.describe()


DEAD_DECODE_HOOK = os.path.join(os.path.dirname(__file__), "..", "support", "dead_decode.py")
# Both rooms bootstrapped (decode's metadata for both at prefill) in one wave before the first
# is sent; test/support/dead_decode.py kills decode as room 1000 is handed to the manager and
# holds room 1001 until prefill has its verdict on the session.
DEAD_DECODE = Scenario(
    name="decode dead before the write, then a second room",
    requests=[RequestSpec([1, 2], [3, 4], aux_index=0, dst_aux_index=0),
              RequestSpec([3], [5], aux_index=1, dst_aux_index=1)],
    kv=KVPoolSpec(num_pages=8),
    wave=2,
    # decode_gone_s: prefill's verdict on the dead session comes after decode is gone; on a
    # loaded machine it may take longer than the harness's default 3 s.
    timeouts=Timeouts(request_s=10, decode_gone_s=20.0),
)
PROBE_DEAD_LINE = "failed a transfer and its probe (rc="
PROBE_DEAD_TAIL = "marked failed, as stock marks it"


def _dead_decode_problem(result):
    """None when decode died (SIGKILL, by the hook) before prefill's engine write of room 1000,
    that write failed for real, prefill marked decode's session failed (stock's "Session ...
    failed." line) and room 1001 then failed on the blacklist without reaching the engine."""
    if result.error:
        return f"run error: {result.error}"
    hook = result.prefill_hook_reports.get("prefill") or {}
    session = hook.get("session")
    if hook.get("error") or not hook.get("killed"):
        return f"the hook did not kill decode: {hook}"
    if hook.get("decode_pid") != result.pids.get("decode") or result.exit_codes.get("decode") != -signal.SIGKILL:
        return f"decode PID {result.pids.get('decode')} exit {result.exit_codes.get('decode')}, hook killed {hook}"
    if hook.get("engine_calls_to_session_before_later_rooms", 0) < 1:
        return f"room 1000 never reached the engine after decode died: {hook}"
    if hook.get("verdict") != "marked failed" or hook.get("later_rooms") != [1001]:
        return f"prefill's verdict on session {session}: {hook.get('verdict')!r}, later rooms {hook.get('later_rooms')}"
    if hook.get("engine_calls_to_session_after_later_rooms") != 0:
        return f"room 1001 reached the engine of a session marked failed: {hook}"
    if not any(f"Session {session} failed." in x for x in hook.get("session_log", [])):
        return f"no \"Session {session} failed.\" line: {hook.get('session_log')}"
    first, second = result.requests
    engine_failure = "Failed to send kv chunk of 1000"
    if first.prefill_status != "Failed" or engine_failure not in (first.prefill_failure_reason or ""):
        return f"room 1000: prefill {first.prefill_status} {first.prefill_failure_reason!r}, not the engine failure"
    want = f"Decode instance could be dead, remote mooncake session {session} is not alive"
    if second.prefill_status != "Failed" or second.prefill_failure_reason != want:
        return f"room 1001: prefill {second.prefill_status} {second.prefill_failure_reason!r}, not {want!r}"
    if first.decode_status is not None or second.decode_status is not None:
        return "decode recorded a final state after it was killed"
    return None


@pytest.mark.skipif(not LIVE and not PATCHED, reason=f"n/a: F6 is not live on SGLang {POLICY.version}, so "
                    "mooncake-ext is not F6's classes here")
@pytest.mark.timeout(300)
def test_dead_decode_is_blacklisted_as_stock_does():
    """A peer that is really gone: decode is SIGKILLed (``test/support/dead_decode.py``) before
    prefill's engine writes room 1000 to it, and its session port refuses connections, so that
    write fails for real. Stock: the transfer thread marks the session failed after the one
    failure. Ext: the session is probed first, the probe fails, and it is marked failed as stock
    marks it (log line, ``session_probes_total{fix="F6",result="dead"}``). Both: room 1001, to the
    same session, fails on the blacklist ("... is not alive") without an engine call. On sources
    carrying patches/'s F6 diff, SGLang's own ``mooncake`` probes (synchronously) and must end
    the same way; ``mooncake-ext`` adds nothing there and is not run."""
    env = {"SGLANG_HARNESS_PREFILL_HOOK": f"{os.path.abspath(DEAD_DECODE_HOOK)}:kill_decode_before_transfer"}
    stock = run_scenario(DEAD_DECODE, "mooncake", extra_env=env)
    assert stock.prefill_manager.startswith("sglang.srt.disaggregation.mooncake.conn."), stock.describe()
    problem = _dead_decode_problem(stock)
    assert problem is None, f"stock: {problem}\n{stock.describe()}\n{stock.prefill_hook_reports}"
    if PATCHED:
        return

    ext = run_scenario(DEAD_DECODE, "mooncake-ext", extra_env=env)
    assert ext.prefill_manager.startswith("sglang_disagg_ext."), ext.describe()
    problem = _dead_decode_problem(ext)
    assert problem is None, f"ext: {problem}\n{ext.describe()}\n{ext.prefill_hook_reports}"
    log = ext.prefill_hook_reports["prefill"]["session_log"]
    assert any(PROBE_DEAD_LINE in x and PROBE_DEAD_TAIL in x for x in log), log
    metrics = ext.plugin_metrics["prefill"]
    probes = "sglang_disagg_ext_session_probes_total"
    assert plugin_metrics.value(metrics, probes, fix="F6", result="dead") == 1.0, metrics
    assert plugin_metrics.value(metrics, probes, fix="F6", result="alive") == 0.0, metrics
