"""F8 differential tests on the real Mooncake engine (TCP, 127.0.0.1): thread survival.

The fault is injected at one manager method in the prefill process
(``test/support/prefill_faults.py``, loaded through the harness's
``SGLANG_HARNESS_PREFILL_HOOK`` after the manager exists), the same call for
stock and ext:

* ``send_aux`` on the transfer worker, for room 1000 (its KV pages already went
  out): the stock loop re-raises it as "Transfer thread failed ...";
* ``update_status(1000, WaitingForInput)`` on the bootstrap thread, after decode's
  pre-alloc message for room 1000 was registered.

Stock (F8 live on every release): the thread dies of the fault, and room 1000
and room 1001 behind it end on decode only through SGLang's waiting timeout
(``stock_signature``). Ext: room 1000 Failed on both sides well under the
timeouts, prefill's reason naming the fault, no thread death, nothing written
outside room 1000's pages; room 1001 Success, every destination byte checked
and every other page still the sentinel (the harness's decode verification).
"""

import dataclasses
import os

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.scenarios.mooncake import FAILED_WITHIN_S, STOCK_TIMEOUTS, _decode_waited_out
from sglang_disagg_ext.selftest.scenarios.thread_survival import FAULT_TEXT, SCENARIOS, _two_requests
from support import plugin_metrics

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()
HOOKS = os.path.join(os.path.dirname(__file__), os.pardir, "support", "prefill_faults.py")


def _run(builtin, backend, scenario=None):
    env = {"SGLANG_HARNESS_PREFILL_HOOK": f"{os.path.abspath(HOOKS)}:{builtin.prefill_hook}"}
    return run_scenario(scenario or builtin.scenario_for(POLICY, backend), backend, extra_env=env)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("builtin", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_stock_thread_dies_ext_fails_the_room_and_serves_the_next(builtin):
    if "F8" in POLICY.patched:
        pytest.skip("n/a: these sources carry patches/'s F8 diff; the patched test below runs instead")
    if not POLICY.is_live("F8"):
        pytest.skip(f"F8 is not live on SGLang {POLICY.version}")
    ext = _run(builtin, "mooncake-ext")
    assert builtin.evaluate(ext), ext.describe()
    bad, good = ext.requests
    assert "InjectedFault: injected fault" in bad.prefill_failure_reason, ext.describe()
    assert good.success and good.bytes_verified, ext.describe()

    stock = _run(builtin, "mooncake")
    assert not builtin.evaluate(stock), stock.describe()
    why = builtin.stock_signature(stock, POLICY)
    assert why is None, f"stock failed, but not with the live bug's signature: {why}\n{stock.describe()}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("builtin", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_patched_sglang_fails_the_room_and_serves_the_next(builtin):
    """patches/<release>/'s F8 diff in SGLang's own loops (`make test-patched`): stock does
    what -ext does on the unpatched wheel (the same evaluation: room 1000 Failed on both sides
    at once with the fault in prefill's reason, no thread died, room 1001 byte-verified). The
    unpatched wheel's stock run of the same scenario fails it (the test above)."""
    if "F8" not in POLICY.patched:
        pytest.skip("n/a: these SGLang sources do not carry patches/'s F8 diff")
    stock = _run(builtin, "mooncake", builtin.build(POLICY))  # -ext's bounds: stock must pass here
    assert builtin.evaluate(stock), stock.describe()
    bad, good = stock.requests
    assert "InjectedFault: injected fault" in bad.prefill_failure_reason, stock.describe()
    assert good.success and good.bytes_verified, stock.describe()


def _decode_loop_run(backend):
    """Room 1000 and room 1001 (``thread_survival._two_requests``); on decode, the Mooncake
    decode message loop's ``update_status(1000, Success)`` raises once
    (``prefill_faults.raise_on_status_success``, a decode manager hook): the loop is handling
    prefill's Success message for room 1000 when it meets the fault."""
    scn = dataclasses.replace(_two_requests(f"F8 decode loop raises ({backend})"), timeouts=STOCK_TIMEOUTS)
    env = {"SGLANG_HARNESS_DECODE_MANAGER_HOOK": f"{os.path.abspath(HOOKS)}:raise_on_status_success"}
    return run_scenario(scn, backend, extra_env=env)


def _decode_loop_survived(result, counted: bool) -> None:
    """Room 1000 Failed on decode at once with the fault in its reason (prefill had concluded
    Success: its bytes went out), room 1001 Success with every byte checked, no thread died;
    ``counted``: the plugin counted one decode-side recovery."""
    bad, good = result.requests
    assert bad.decode_status == "Failed" and FAULT_TEXT in (bad.decode_failure_reason or ""), result.describe()
    assert bad.decode_seconds is not None and bad.decode_seconds <= FAILED_WITHIN_S, result.describe()
    assert bad.prefill_status == "Success", result.describe()
    assert good.success and good.bytes_verified, result.describe()
    assert not any(r.thread_errors for r in result.requests), result.describe()
    if counted:
        assert plugin_metrics.value(result.plugin_metrics["decode"], "sglang_disagg_ext_thread_recoveries_total",
                                    role="decode") == 1.0, result.plugin_metrics


@pytest.mark.timeout(300)
def test_decode_loop_fault_stock_thread_dies_ext_fails_the_room_and_serves_the_next():
    """F8 on decode's side. Stock: the decode loop dies of the fault, so neither room's
    Success message is ever handled: both end on decode only by SGLang's waiting timeout.
    Ext: room 1000 Failed on decode at once, the loop re-entered, room 1001 served
    (``_decode_loop_survived``). On sources carrying patches/'s F8 diff (its decode loop is
    patched too) stock must do what -ext does."""
    if "F8" in POLICY.patched:
        _decode_loop_survived(_decode_loop_run("mooncake"), counted=False)
        return
    if not POLICY.is_live("F8"):
        pytest.skip(f"F8 is not live on SGLang {POLICY.version}")
    _decode_loop_survived(_decode_loop_run("mooncake-ext"), counted=True)

    stock = _decode_loop_run("mooncake")
    bad, good = stock.requests
    died = [t for t in bad.thread_errors if t.startswith("decode ") and FAULT_TEXT in t]
    assert died, f"no decode thread died of the fault: {bad.thread_errors}\n{stock.describe()}"
    for r in (bad, good):
        why = _decode_waited_out(r, STOCK_TIMEOUTS.sglang_waiting_s)
        assert why is None, f"{why}\n{stock.describe()}"
