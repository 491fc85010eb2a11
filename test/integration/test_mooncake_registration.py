"""F9 on the real Mooncake engine (TCP, 127.0.0.1): a decode whose metadata buffers differ is refused at registration.

Each scenario (``selftest.scenarios.registration``) runs two requests through
the transfer harness: two processes, SGLang's real bootstrap server,
managers, senders and receivers, CPU tensors as pools, a real Mooncake
TransferEngine; decode checks every destination page and row byte for byte
and that every other one still holds its sentinel.

Injection: the harness builds SGLang's own ``MetadataBuffers`` on one side
with ``kv_checksum_enabled=True`` (``Scenario.kv_checksum_on``, 0.5.21+),
exactly the argument the scheduler passes for
``--disaggregation-enable-kv-checksum``: that side registers one more metadata
buffer; or (every release) decode's with a larger hidden size
(``Scenario.decode_hidden_size``), as the scheduler sizes them on an engine
that runs speculative decoding: same count, larger hidden-state rows. Nothing
in SGLang or the plugin is replaced.
"""

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario
from sglang_disagg_ext.selftest.scenarios.registration import (
    CHECKSUM_SCENARIOS,
    HINT,
    REFUSALS,
    ROW_SIZE,
    ROW_SIZE_REFUSAL,
    SCENARIOS,
    STOCK_DECODE_REFUSAL,
    checksum_on,
    refusal_problem,
)

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()
PATCHED = "F9" in POLICY.patched
live_only = pytest.mark.skipif(
    not POLICY.is_live("F9"),
    reason=("n/a: these sources carry patches/'s F9 diff; the patched test below runs instead" if PATCHED
            else f"F9 is not live on SGLang {POLICY.version}"),
)
# patches/0.5.23's F9 diff: SGLang's own reason (counts only: a stock decode publishes no row sizes),
# written out by hand from the harness's geometry (ten metadata buffers, the checksum an eleventh).
STOCK_DECODE_FAILED = "Failed to get kvcache from prefill instance, it might be dead"
PATCHED_REFUSALS = {
    "decode": f"metadata buffers cannot be paired: prefill has 10, decode 11; {HINT}",
    "prefill": f"metadata buffers cannot be paired: prefill has 11, decode 10; {HINT}",
}
REFUSED_LINE = "refused at registration; every request to it ends Failed"
COUNT_ONLY_LINE = (
    "published no metadata row sizes (a stock decode): only its buffer count (10, as prefill's) was checked"
)
# -ext's reason per scenario (registration.py's module docstring derives them).
EXT_REFUSALS = {
    CHECKSUM_SCENARIOS[0].name: REFUSALS["decode"],
    CHECKSUM_SCENARIOS[1].name: REFUSALS["prefill"],
    ROW_SIZE.name: ROW_SIZE_REFUSAL,
}
needs_checksum_buffer = pytest.mark.skipif(
    not releases.features().metadata_buffers_kv_checksum,
    reason=f"n/a: SGLang {POLICY.version}'s MetadataBuffers has no KV-checksum buffer (0.5.21+)",
)


def _buildable(builtin):
    if builtin.buildable is None or builtin.buildable():
        return builtin
    return pytest.param(builtin, marks=pytest.mark.skip(
        reason=f"n/a: SGLang {POLICY.version} cannot build {builtin.name!r} (no KV-checksum buffer before 0.5.21)"))


@live_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("builtin", [_buildable(b) for b in SCENARIOS], ids=["decode+1", "decode-1", "rows"])
def test_stock_serves_mismatched_metadata_ext_refuses_at_registration(builtin):
    """Stock: both requests Success with the metadata paired by position (0.5.23 logs one ERROR
    at registration for a count difference; decode's checksum row, when decode has one, never
    written; decode's larger hidden-state row never written, prefill's landing elsewhere in that
    buffer). Ext: one ERROR at registration naming both counts and the row sizes; each request
    Failed on both sides within the bound with that reason; no KV page and no metadata row of
    decode written."""
    stock = run_scenario(builtin.scenario_for(POLICY, "mooncake"), "mooncake")
    why = builtin.stock_signature(stock, POLICY)
    assert why is None, f"stock did not show the live bug's shape: {why}\n{stock.describe()}"
    assert not builtin.evaluate(stock)

    ext = run_scenario(builtin.scenario_for(POLICY, "mooncake-ext"), "mooncake-ext")
    problem = refusal_problem(ext, EXT_REFUSALS[builtin.name])
    assert problem is None, f"{problem}\n{ext.describe()}"
    assert builtin.evaluate(ext)
    # One error for the session, at registration; stock's "only the first 10
    # are transferred" line is replaced (that is no longer what happens).
    assert ext.prefill_log_tail.count(REFUSED_LINE) == 1, ext.prefill_log_tail
    assert "only the first 10 are transferred" not in ext.prefill_log_tail


@live_only
@needs_checksum_buffer
@pytest.mark.timeout(300)
def test_stock_decode_with_one_more_buffer_is_refused_on_the_count():
    """Ext prefill, stock decode with the checksum buffer: the count (stock frame 5) is enough
    to refuse; the reason says decode's row sizes are unknown."""
    result = run_scenario(checksum_on("decode"), "mooncake-ext", decode_backend="mooncake")
    assert result.decode_manager.startswith("sglang.srt.disaggregation.mooncake.conn."), result.describe()
    problem = refusal_problem(result, STOCK_DECODE_REFUSAL)
    assert problem is None, f"{problem}\n{result.describe()}"


@live_only
@pytest.mark.timeout(300)
def test_matching_stock_decode_is_served_with_one_line():
    """Ext prefill, stock decode, same buffers: served as in stock, byte for byte, and one INFO
    line says only the count could be checked."""
    scn = Scenario(
        name="same metadata buffers, stock decode",
        requests=[RequestSpec([1, 2], [3, 4], aux_index=1, dst_aux_index=2), RequestSpec([5], [6], aux_index=3)],
        kv=KVPoolSpec(num_pages=8),
    )
    result = run_scenario(scn, "mooncake-ext", decode_backend="mooncake")
    assert result.ok, result.describe()
    assert sum(COUNT_ONLY_LINE in x for x in result.plugin_log["prefill"]) == 1, result.plugin_log["prefill"]
    assert REFUSED_LINE not in result.prefill_log_tail


@pytest.mark.skipif(not PATCHED, reason="n/a: these SGLang sources do not carry patches/'s F9 diff")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("builtin", CHECKSUM_SCENARIOS, ids=["decode+1", "decode-1"])
def test_patched_sglang_refuses_at_registration(builtin):
    """patches/<release>/'s F9 diff in SGLang's own registration (`make test-patched`): stock
    refuses the decode as -ext does on the unpatched wheel (one ERROR at registration naming both
    counts; each request Failed on both sides within the bound, prefill's reason that one, decode's
    stock's generic one; no KV page and no metadata row of decode written). The unpatched wheel's stock run serves the pair with the
    metadata paired by position (the first test)."""
    # -ext's bounds (``build``), not the short ones meant for an expected stock failure.
    stock = run_scenario(builtin.build(POLICY), "mooncake")
    side = builtin.build(POLICY).kv_checksum_on
    # Stock Mooncake's status message carries no reason (the plugin's adds it), so a stock
    # decode records its own generic one (0.5.23 common/conn.py apply_prefill_status).
    problem = refusal_problem(stock, PATCHED_REFUSALS[side], STOCK_DECODE_FAILED)
    assert problem is None, f"{problem}\n{stock.describe()}"
    assert stock.prefill_log_tail.count(REFUSED_LINE) == 1, stock.prefill_log_tail
    assert "only the first 10 are transferred" not in stock.prefill_log_tail
