"""core.registration_check (F9), the row sizes in the F6 frame, the harness's checksum knob, and the
F9 scenarios' stock signature and refusal check on hand-written results.

Every expected text is written out by hand from the inputs in the test.
"""

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.core.index_bounds import (
    IndexBoundsError,
    PoolBounds,
    bounds_in_message,
    bounds_of,
    decode_frame,
    encode_frame,
)
from sglang_disagg_ext.core.registration_check import COUNT_HINT, SIZE_HINT, aux_pairing_problem
from sglang_disagg_ext.selftest.harness import patterns
from sglang_disagg_ext.selftest.harness.run import RequestResult, ScenarioResult
from sglang_disagg_ext.selftest.harness.scenario import AUX_POOL_ID, KV_POOL_ID, RequestSpec, Scenario, ScenarioError
from sglang_disagg_ext.selftest.scenarios import registration

pytestmark = pytest.mark.timeout(30)

# Prefill rows: 64, 64, 512, 128, 64 bytes (five buffers).
PREFILL = [64, 64, 512, 128, 64]


def test_same_buffers_pass_with_or_without_published_sizes():
    assert aux_pairing_problem(PREFILL, 5, [64, 64, 512, 128, 64]) is None
    assert aux_pairing_problem(PREFILL, 5, None) is None  # a stock decode: the count matches
    assert aux_pairing_problem([], 0, []) is None


def test_decode_with_one_more_trailing_buffer():
    assert aux_pairing_problem(PREFILL, 6, [64, 64, 512, 128, 64, 64]) == (
        "metadata buffers cannot be paired: prefill has 5, decode 6; bytes per row from buffer 5 on: "
        f"prefill [], decode [64]; {COUNT_HINT}"
    )


def test_decode_with_one_fewer_buffer_in_the_middle():
    # Decode lacks prefill's buffer 2 (512 B): rows agree for buffers 0 and 1 only.
    assert aux_pairing_problem(PREFILL, 4, [64, 64, 128, 64]) == (
        "metadata buffers cannot be paired: prefill has 5, decode 4; bytes per row from buffer 2 on: "
        f"prefill [512, 128, 64], decode [128, 64]; {COUNT_HINT}"
    )


def test_stock_decode_is_judged_on_the_count():
    assert aux_pairing_problem(PREFILL, 6, None) == (
        f"metadata buffers cannot be paired: prefill has 5, decode 6 (decode's row sizes unknown); {COUNT_HINT}"
    )


def test_same_count_different_row_size():
    # Buffer 3 (hidden states): 128 B on prefill, 256 B on decode.
    assert aux_pairing_problem(PREFILL, 5, [64, 64, 512, 256, 64]) == (
        "metadata buffers cannot be paired: 5 on each side, but bytes per row differ from buffer 3 on: "
        f"prefill [128, 64], decode [256, 64]; {SIZE_HINT}"
    )


def test_published_sizes_that_disagree_with_the_count_are_not_used():
    # 6 sizes for 5 registered buffers: the count alone decides (it matches).
    assert aux_pairing_problem(PREFILL, 5, [64, 64, 512, 128, 64, 64]) is None
    # ... and with a count that differs, the reason says the sizes are unknown.
    assert "decode 4 (decode's row sizes unknown)" in aux_pairing_problem(PREFILL, 4, [1, 2, 3])


def test_frame_carries_aux_row_sizes():
    b = bounds_of([3072], [256], [512, 4096], [64, 512], [], [])
    assert b.aux_item_lens == (64, 512)
    frame = encode_frame(b)
    assert b'"aux_item_lens": [64, 512]' in frame
    assert decode_frame(frame) == b
    assert bounds_in_message([b"None", b"127.0.0.1", b"1", b"s:1", frame]).aux_item_lens == (64, 512)
    # No aux buffers: nothing published, and the key is absent (a frame as F6 wrote it).
    none = bounds_of([3072], [256], [], [], [], [])
    assert none.aux_item_lens is None and b"aux_item_lens" not in encode_frame(none)
    assert decode_frame(encode_frame(PoolBounds(kv=12, aux=8))) == PoolBounds(kv=12, aux=8, aux_item_lens=None)


@pytest.mark.parametrize("value", [b'"64"', b"[64, 0]", b"[64, true]", b"[-1]"])
def test_malformed_row_sizes_raise(value):
    frame = encode_frame(PoolBounds(kv=12, aux=8))[:-1] + b', "aux_item_lens": ' + value + b"}"
    with pytest.raises(IndexBoundsError, match="aux_item_lens"):
        decode_frame(frame)


def _scn(side: str) -> Scenario:
    return Scenario(name="t", requests=[RequestSpec([1], [2], aux_index=1, dst_aux_index=2)], kv_checksum_on=side)


def test_decode_only_checksum_buffer_receives_nothing():
    # Decode has 11 aux buffers, the 11th (index 10) its checksum buffer.
    scn = _scn("decode")
    assert patterns.source_buffer(scn, AUX_POOL_ID, 10, 11) == (None, [])
    assert patterns.source_buffer(scn, AUX_POOL_ID, 9, 11) == (9, [])
    assert patterns.source_buffer(scn, KV_POOL_ID, 3, 4) == (3, [])
    # Checksum on both sides, or on prefill only: decode's buffers all have a same-index source.
    assert patterns.source_buffer(_scn("both"), AUX_POOL_ID, 10, 11) == (10, [])
    assert patterns.source_buffer(_scn("prefill"), AUX_POOL_ID, 9, 10) == (9, [])


def test_kv_checksum_on_is_validated():
    for side in ("none", "prefill", "decode", "both"):
        _scn(side).validate()
    with pytest.raises(ScenarioError, match="kv_checksum_on 'left' not one of none, prefill, decode, both"):
        _scn("left").validate()
    assert Scenario.from_json(_scn("decode").to_json()).kv_checksum_on == "decode"


# -- the scenarios' stock signature and -ext refusal check, on hand-written results ----

P0523 = releases.policy_for("0.5.23")
STOCK_LINE = (
    "2026-11-23 16:35:12,638 sglang.srt.disaggregation.common.conn ERROR Decode 127.0.0.1:15261 registered 11 "
    "metadata buffers but this prefill has 10; only the first 10 are transferred, and misaligned if the extra "
    "buffer is not the last."
)
WHY = "decode session 127.0.0.1:15162: " + registration.REFUSALS["decode"]


def _served(tail=STOCK_LINE, **kw):
    reqs = [RequestResult(i, 1000 + i, "Success", "Success", 0.01, 0.02, True) for i in range(2)]
    return ScenarioResult("kv checksum on decode only", "mooncake", requests=reqs, prefill_log_tail=tail, **kw)


def _refused(mismatch="kv buffer 0 page 3: expected prefill page 1's bytes, found the sentinel (never written)"):
    reqs = [
        RequestResult(i, 1000 + i, "Failed", "Failed", 0.001, 0.02, False, [mismatch],
                      prefill_failure_reason=WHY, decode_failure_reason=WHY)
        for i in range(2)
    ]
    return ScenarioResult("kv checksum on decode only", "mooncake-ext", requests=reqs)


@pytest.fixture
def installed_023(monkeypatch):
    """The signatures read the installed SGLang's shape (a run is always on it): pose as 0.5.23's."""
    monkeypatch.setattr(releases.features(), "mooncake_aux_count_check", True)
    monkeypatch.setattr(releases.features(), "metadata_buffers_kv_checksum", True)


@pytest.fixture
def installed_022(monkeypatch):
    """As 0.5.21-0.5.22: the checksum buffer exists, no count check at registration."""
    monkeypatch.setattr(releases.features(), "mooncake_aux_count_check", False)
    monkeypatch.setattr(releases.features(), "metadata_buffers_kv_checksum", True)


def test_stock_signature_is_served_with_one_registration_line(installed_023):
    builtin = registration.SCENARIOS[0]  # checksum on decode
    assert builtin.stock_signature(_served(), P0523) is None
    assert "found 0" in builtin.stock_signature(_served(tail="nothing logged"), P0523)
    assert "worker error" in builtin.stock_signature(_served(error="decode: RuntimeError: engine"), P0523)
    bad = _served()
    bad.requests[1].bytes_verified = False
    assert "request 1: stock serves the pair" in builtin.stock_signature(bad, P0523)
    # Patched sources carry the fix (upstream): no stock expectation to match.
    patched = releases.with_patched_fixes(P0523, ("F9",))
    assert "not expected to fail" in builtin.stock_signature(_served(), patched)


def _thread_died(thread_error="prefill Thread-5 (transfer_worker): RuntimeError: Transfer thread failed because of "
                              "list index out of range. Prefill instance with bootstrap_port=28889 is dead."):
    reqs = [
        RequestResult(i, 1000 + i, "Failed", "Failed", 4.0, 4.0, False,
                      ["aux buffer 0 page 2: expected prefill page 1's bytes, found the sentinel (never written)"],
                      thread_errors=[thread_error] if i == 0 else [])
        for i in range(2)
    ]
    return ScenarioResult("kv checksum on decode only", "mooncake", requests=reqs, prefill_log_tail="")


def test_stock_signature_before_the_count_check(installed_022):
    """0.5.22: checksum on decode kills prefill's transfer thread (send_aux indexes prefill's row
    sizes with decode's list); on prefill, served without a word."""
    p0522 = releases.policy_for("0.5.22")
    on_decode, on_prefill = registration.SCENARIOS[0], registration.SCENARIOS[1]
    assert on_decode.stock_signature(_thread_died(), p0522) is None
    assert "list index out of range" in on_decode.stock_signature(_thread_died("prefill: other"), p0522)
    assert "found 1" in on_decode.stock_signature(_served(), p0522)  # 0.5.23's line cannot appear there
    served = _served(tail="")
    assert on_prefill.stock_signature(served, p0522) is None
    assert "both sides Failed" in on_decode.stock_signature(served, p0522)


def test_row_size_signature_and_refusal(installed_022):
    """Row sizes (every release): stock Success with mismatches in the hidden-state buffer only."""
    p0511 = releases.policy_for("0.5.11")
    rows = registration.ROW_SIZE
    reqs = [RequestResult(i, 1000 + i, "Success", "Success", 0.01, 0.02, False,
                          ["aux buffer 8 page 2: expected prefill page 1's bytes, found the sentinel (never written)",
                           "aux buffer 8 page 1: must be untouched, found prefill page 1's bytes"]) for i in range(2)]
    stock = ScenarioResult(rows.name, "mooncake", requests=reqs)
    assert rows.stock_signature(stock, p0511) is None
    stock.requests[1].mismatches.append("aux buffer 9 page 4: expected prefill page 3's bytes, found the sentinel")
    assert "outside the hidden-state buffer" in rows.stock_signature(stock, p0511)
    right = ScenarioResult(rows.name, "mooncake", requests=[
        RequestResult(i, 1000 + i, "Success", "Success", 0.01, 0.02, True) for i in range(2)])
    assert "every byte is right" in rows.stock_signature(right, p0511)
    why = "decode session 127.0.0.1:15162: " + registration.ROW_SIZE_REFUSAL
    refused = ScenarioResult(rows.name, "mooncake-ext", requests=[
        RequestResult(i, 1000 + i, "Failed", "Failed", 0.001, 0.02, False,
                      ["aux buffer 8 page 2: expected prefill page 1's bytes, found the sentinel (never written)"],
                      prefill_failure_reason=why, decode_failure_reason=why) for i in range(2)])
    assert rows.evaluate(refused) and not rows.evaluate(stock)
    # The expected reason, derived by hand in registration.py, is what the pure check says.
    prefill = [64, 64, 64, 64, 512, 512, 64, 128, 128, 64]
    decode = prefill[:8] + [256, 64]
    assert aux_pairing_problem(prefill, 10, decode) == registration.ROW_SIZE_REFUSAL


def test_checksum_rows_need_the_checksum_buffer(monkeypatch):
    monkeypatch.setattr(releases.features(), "metadata_buffers_kv_checksum", False)
    assert not registration.SCENARIOS[0].applies(P0523)
    assert registration.ROW_SIZE.applies(releases.policy_for("0.5.11"))


def test_refusal_check(installed_023):
    assert registration.refusal_problem(_refused(), registration.REFUSALS["decode"]) is None
    stray = _refused("aux buffer 3 page 2: expected prefill page 1's bytes, found prefill page 1's bytes")
    assert "decode written by a refused request" in registration.refusal_problem(stray, registration.REFUSALS["decode"])
    assert "does not say" in registration.refusal_problem(_refused(), registration.REFUSALS["prefill"])
    assert "not Failed on both sides" in registration.refusal_problem(_served(), registration.REFUSALS["decode"])
