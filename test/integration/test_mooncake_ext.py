"""F1/F2 differential tests on the real Mooncake engine (TCP, 127.0.0.1).

Each scenario runs twice through the transfer harness: prefill and decode are
two processes with SGLang's real bootstrap server, managers, senders and
receivers, CPU tensors as pools and a real Mooncake TransferEngine. Decode
checks every destination page byte for byte and that every other page still
holds its sentinel. Nothing is replaced.

Where the installed release has the bug (``releases.py``: live) stock must
fail with that scenario's signature (``BuiltinScenario.stock_signature``: the
failure the live bug produces, never a setup/harness error or a deadline) and
ext must pass; where the release has the fix, both must pass.
"""

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.scenarios.mooncake import scenarios_for

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()
# The plugin's state classes (F1/F2 code) run only where F1 or F2 is live; elsewhere
# only the scenarios SGLang's own state path handles apply (not the plugin-only
# failure path of that code).
STATE_CLASSES = POLICY.is_live("F1") or POLICY.is_live("F2")
SCENARIOS = [s for s in scenarios_for(POLICY) if STATE_CLASSES or not s.plugin_only]
STOCK_MODULE = "sglang.srt.disaggregation.mooncake.conn."
EXT_MODULE = "sglang_disagg_ext.backends.mooncake." if POLICY.routes("mooncake") else STOCK_MODULE


def _run(builtin, backend):
    result = run_scenario(builtin.scenario_for(POLICY, backend), backend)
    return builtin.evaluate(result), result


@pytest.mark.timeout(400)
@pytest.mark.parametrize("builtin", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_stock_vs_ext(builtin):
    stock_expected = builtin.stock_expectation(POLICY)
    stock_ok, stock = _run(builtin, "mooncake")
    ext_ok, ext = _run(builtin, "mooncake-ext")

    # Both sides' managers: ext runs the plugin's (or, pass-through, SGLang's via the -ext
    # name), stock runs SGLang's own.
    for side in ("prefill_manager", "decode_manager"):
        assert (getattr(ext, side) or "").startswith(EXT_MODULE), ext.describe()
        assert (getattr(stock, side) or "").startswith(STOCK_MODULE), stock.describe()
    assert ext_ok, ext.describe()
    # Both sides reach a final state within the bound, with ext.
    assert all(not r.timed_out for r in ext.requests), ext.describe()
    if stock_expected == "fail":
        assert not stock_ok, f"stock SGLang {POLICY.version} passed a scenario it should fail:\n{stock.describe()}"
        # ... and failed the way the live bug does, not through the rig (setup, harness, deadline).
        why = builtin.stock_signature(stock, POLICY)
        assert why is None, f"stock failed, but not with the live bug's signature: {why}\n{stock.describe()}"
    else:
        assert stock_ok, stock.describe()


@pytest.mark.timeout(400)
def test_ext_name_on_this_release_transfers_state():
    """On every supported release (pass-through included) the -ext name works end to end.

    Where a Mooncake fix is live: the plugin's manager. Elsewhere (pass-through): the
    stock manager, reached through the -ext name, with the same result as stock.
    """
    from sglang_disagg_ext.selftest.harness.scenario import with_state

    result = run_scenario(with_state("ext name smoke", "swa", [1, 2, 3, 4, 5], [6, 7, 8]), "mooncake-ext")
    assert result.ok, result.describe()
    assert result.prefill_manager.startswith(EXT_MODULE), result.describe()
    assert result.decode_manager.startswith(EXT_MODULE), result.describe()
    # The activation line reaches the log of each process that transfers, at INFO
    # (SGLang's default level), naming the release, the backend and what is routed.
    for role in ("prefill", "decode"):
        lines = result.plugin_log[role]
        if POLICY.routes("mooncake"):
            announced = [x for x in lines if "active in this process" in x]
            assert len(announced) == 1, lines
            assert f"SGLang {POLICY.version} (active)" in announced[0], announced
            assert "mooncake-ext -> MooncakeKVManager" in announced[0], announced
            manager = getattr(result, f"{role}_manager").rsplit(".", 1)[1]
            assert f", {manager})" in announced[0], announced
        else:
            assert any("mooncake-ext -> stock mooncake classes (pass-through)" in x for x in lines), lines


@pytest.mark.timeout(400)
def test_ext_serves_many_requests_with_mixed_lengths():
    """Several requests in a row on one manager pair, lengths in both directions."""
    from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, StatePoolSpec, StateSpec

    kind = "swa"
    requests = [
        RequestSpec([1, 2], [3, 4], aux_index=0, dst_aux_index=0, state=[StateSpec(kind, [1, 2, 3, 4, 5], [6, 7, 8])]),
        RequestSpec([5, 6], [7, 8], aux_index=1, dst_aux_index=1, state=[StateSpec(kind, [9, 10], [11, 12, 13])]),
        RequestSpec([9], [10], aux_index=2, dst_aux_index=2, state=[StateSpec(kind, [14], [15])]),
        RequestSpec([11], [12], aux_index=3, dst_aux_index=3, state=[StateSpec(kind, [], [0])]),
    ]
    scenario = Scenario(
        name="four requests, mixed lengths",
        requests=requests,
        kv=KVPoolSpec(num_pages=14),
        state_pools=[StatePoolSpec(kind=kind, num_pages=16)],
    )
    result = run_scenario(scenario, "mooncake-ext")
    assert result.ok, result.describe()
    if STATE_CLASSES:
        # Requests 0, 1 and 3 are trimmed; the plugin logs the first at WARNING and
        # holds the rest back for a minute (one line per component and kind).
        trims = [line for r in result.requests for line in r.prefill_log if "side trimmed" in line]
        assert len(trims) == 1, trims
        assert "state component 0 (swa): len(prefill_state_indices)=5, len(dst_state_indices)=3" in trims[0], trims
