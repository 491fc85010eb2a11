"""F7 differential tests on the real Mooncake engine (TCP, 127.0.0.1): state buffers paired by layer.

Prefill's paged state pool has ``n`` layers, decode's ``n + extra`` (an MTP /
nextn draft layer at the tail: the harness builds decode's pool with
``StatePoolSpec.decode_extra_layers``). Nothing in SGLang is replaced or
injected: the only difference between the two runs is the backend name. The
plugin's change sits at the narrowest point, ``get_mha_kv_ptrs_with_pp`` for
calls carrying a state component's buffers (``backends/mooncake/state_pairing``).
Decode verifies every page byte for byte: prefill layer L's pages in decode
layer L, every other page (the draft layers' included) still the sentinel.
"""

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.scenarios.state_pairing import SCENARIOS, STOCK_WRONG, tail_layers

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()
LIVE = POLICY.support is releases.Support.ACTIVE and POLICY.is_live("F7")
EXT_MODULE = "sglang_disagg_ext.backends.mooncake."


PATCHED = "F7" in POLICY.patched


@pytest.mark.skipif(not LIVE, reason=("n/a: these sources carry patches/'s F7 diff; the patched test below runs instead"
                                      if PATCHED else f"F7 is not live on SGLang {POLICY.version}"))
@pytest.mark.timeout(300)
@pytest.mark.parametrize("builtin", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_stock_shifts_v_buffers_ext_pairs_by_layer(builtin):
    """Stock: Success on both sides with prefill's V pages in decode's draft K buffers and
    the wrong V buffers (exactly ``STOCK_WRONG``); ext: every page right, draft layers untouched."""
    stock = run_scenario(builtin.scenario_for(POLICY, "mooncake"), "mooncake")
    assert not builtin.evaluate(stock), f"stock passed:\n{stock.describe()}"
    why = builtin.stock_signature(stock, POLICY)
    assert why is None, f"stock failed, but not with F7's signature: {why}\n{stock.describe()}"

    ext = run_scenario(builtin.scenario_for(POLICY, "mooncake-ext"), "mooncake-ext")
    assert ext.ok, ext.describe()
    assert ext.prefill_manager.startswith(EXT_MODULE), ext.describe()
    r = ext.requests[0]
    assert r.prefill_status == r.decode_status == "Success", ext.describe()


# (n, extra) where decode's layer count is a multiple of prefill's: stock's guess takes
# the "equal PP split" branch, which for a single pool happens to pair layer L with L.
CONTROLS = [(1, 1), (1, 2), (2, 2)]


@pytest.mark.skipif(not (LIVE or PATCHED), reason=f"F7 is not live on SGLang {POLICY.version}")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,extra", CONTROLS, ids=[f"swa {n} layers, decode +{e}" for n, e in CONTROLS])
def test_controls_stock_and_ext_both_right(n, extra):
    assert (n, extra) not in STOCK_WRONG
    for backend in ("mooncake", "mooncake-ext"):
        result = run_scenario(tail_layers("swa", n, extra), backend)
        assert result.ok, f"{backend}:\n{result.describe()}"


@pytest.mark.skipif(not PATCHED, reason="n/a: these SGLang sources do not carry patches/'s F7 diff")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("builtin", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_patched_sglang_pairs_by_layer(builtin):
    """patches/<release>/'s F7 diff in SGLang's own state path (`make test-patched`): stock
    places every page as -ext does on the unpatched wheel (Success on both sides, prefill layer
    L in decode layer L, the draft layers still the sentinel). The unpatched wheel's stock run
    of the same scenario shifts the V buffers (the test above). Stock runs under -ext's bounds
    here (``build``), not the short ones meant for an expected stock failure."""
    stock = run_scenario(builtin.build(POLICY), "mooncake")
    assert stock.ok, stock.describe()
    r = stock.requests[0]
    assert r.prefill_status == r.decode_status == "Success", stock.describe()
