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

import os

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.scenarios.thread_survival import SCENARIOS

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
