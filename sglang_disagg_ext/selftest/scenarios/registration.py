"""F9 scenarios: the two sides' metadata buffers differ in count or in row size.

Count (0.5.21+, whose ``MetadataBuffers`` has the optional checksum buffer).
The harness builds SGLang's real ``MetadataBuffers`` on each side, on one
side with ``kv_checksum_enabled=True`` (what ``--disaggregation-enable-kv-checksum``
passes; ``Scenario.kv_checksum_on``): that side registers one more metadata
buffer, the last. Two requests to the same decode follow.

Stock 0.5.23 logs the difference at registration ("registered 11 metadata
buffers but this prefill has 10; only the first 10 are transferred ...") and
serves the pair: both requests Success, the shared buffers right, and
decode's checksum buffer never written (decode enabled checksums and gets
none). Stock 0.5.21 and 0.5.22 say nothing and, with the checksum on decode, the
transfer thread dies on the first request (``send_aux`` indexes prefill's row
sizes with decode's buffer list); with it on prefill, the checksum is never
sent. ``-ext``: the decode session is refused at registration; every request
ends Failed on both sides within a bound with a reason naming both counts and
the differing row sizes, and nothing is written to decode (KV pages and
metadata rows all still the sentinel).

Row size (every release): decode builds its metadata buffers with a larger
hidden size (``Scenario.decode_hidden_size``), as SGLang does on an engine
that runs speculative decoding (the draft model's hidden size; 16 elements
without it). Same count, one buffer's rows larger. Stock, every release: it
addresses decode's rows with prefill's row size (``send_aux``), so prefill's
hidden-state row lands in the wrong place of decode's buffer and decode's own
row is never written; both requests Success. ``-ext``: refused at
registration as above, naming the buffer and both row sizes.

Expected texts are written out by hand. 0.5.23's metadata buffers with the
harness's geometry (hidden size 64, bfloat16; sampling mask and DSA top-k off),
bytes per row: output_ids 16 x int32 = 64, cached_tokens 64, output token
logprob value and index 64 each, top logprobs value and index 128 x 4 = 512
each, top-k p 16 x fp32 = 64, top-k index 16 x int64 = 128, hidden states 64 x
bf16 = 128, bootstrap room 8 x uint64 = 64: ten buffers. The KV checksum is an
eleventh, 8 x uint64 = 64 bytes per row. Every release 0.5.10.post1-0.5.23
lists the same ten in the same order (``get_buf_infos``; the optional ones,
off here, go before the hidden states or after them), so the hidden-state
buffer is buffer 8; with hidden size 128 on decode its rows are 128 x bf16 =
256 bytes.
"""

from __future__ import annotations

from typing import Optional

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario
from sglang_disagg_ext.selftest.scenarios.mooncake import BuiltinScenario, refused_request_problem

HINT = (
    "an optional metadata buffer is enabled on one side only (--disaggregation-enable-kv-checksum, "
    "SGLANG_ENABLE_DISAGG_SAMPLING_MASK or the DSA top-k buffer): enable it on both sides or on neither"
)

# -ext's reason for each side with the checksum buffer (see the module docstring).
REFUSALS = {
    "decode": f"metadata buffers cannot be paired: prefill has 10, decode 11; bytes per row from buffer 10 on: "
              f"prefill [], decode [64]; {HINT}",
    "prefill": f"metadata buffers cannot be paired: prefill has 11, decode 10; bytes per row from buffer 10 on: "
               f"prefill [64], decode []; {HINT}",
}
SIZE_HINT = (
    "the engines size a metadata buffer differently (e.g. speculative decoding's hidden-state buffer on one "
    "side only, or a different sampling-mask width): configure both sides alike"
)
# Decode's hidden size in the row-size scenario, and -ext's reason (see the module docstring).
DECODE_HIDDEN_SIZE = 128
ROW_SIZE_REFUSAL = (
    "metadata buffers cannot be paired: 10 on each side, but bytes per row differ from buffer 8 on: "
    f"prefill [128, 64], decode [256, 64]; {SIZE_HINT}"
)
HIDDEN_STATES_LABEL = "aux buffer 8"

# A stock decode publishes no row sizes: only the counts are known.
STOCK_DECODE_REFUSAL = (
    f"metadata buffers cannot be paired: prefill has 10, decode 11 (decode's row sizes unknown); {HINT}"
)

# Stock 0.5.23's one line at registration (common/conn.py check_peer_aux_buffer_count).
STOCK_LINES = {
    "decode": "registered 11 metadata buffers but this prefill has 10; only the first 10 are transferred",
    "prefill": "registered 10 metadata buffers but this prefill has 11; only the first 10 are transferred",
}


def checksum_on(side: str) -> Scenario:
    """Two requests (KV pages and one aux row each) with the checksum buffer on ``side`` only."""
    return Scenario(
        name=f"kv checksum on {side} only",
        requests=[
            RequestSpec([1, 2], [3, 4], aux_index=1, dst_aux_index=2),
            RequestSpec([5], [6], aux_index=3, dst_aux_index=4),
        ],
        kv=KVPoolSpec(num_pages=8),
        kv_checksum_on=side,
    )


def hidden_rows_differ() -> Scenario:
    """Two requests (KV pages and one aux row each); decode's hidden-state rows twice prefill's."""
    return Scenario(
        name="hidden-state rows larger on decode",
        requests=[
            RequestSpec([1, 2], [3, 4], aux_index=1, dst_aux_index=2),
            RequestSpec([5], [6], aux_index=3, dst_aux_index=4),
        ],
        kv=KVPoolSpec(num_pages=8),
        decode_hidden_size=DECODE_HIDDEN_SIZE,
    )


def refusal_problem(result, want: str, decode_want: Optional[str] = None) -> Optional[str]:
    """None when every request was refused the -ext way (Failed on both sides within the bound,
    both reasons saying ``want``, or decode's ``decode_want``, nothing written to decode); else why not."""
    if result.error or len(result.requests) != 2:
        return f"run error or not 2 requests: {result.error}"
    for r in result.requests:
        problem = refused_request_problem(r, want, decode_want)
        if problem:
            return problem
    return None


def _signature(side: str):
    """Stock's shape of the count difference, by release.

    0.5.23 (``check_peer_aux_buffer_count``): one ERROR line at registration naming both
    counts, then both requests Success on both sides with every byte the verifier checks
    right (the shared buffers; with the checksum on decode, its checksum row still the
    sentinel: never sent). 0.5.21-0.5.22 (no check; ``send_aux`` walks decode's buffer list and
    indexes prefill's row sizes with it): checksum on decode, prefill's transfer thread
    dies on ``list index out of range`` and both requests end Failed only through SGLang's
    timeouts; checksum on prefill, both Success without a word, prefill's checksum never
    sent (decode cannot check what prefill's operator enabled)."""

    def check(result, policy) -> Optional[str]:
        # The log tail, not the per-request logs: the registration may come
        # before prefill's first request starts its log window.
        n = result.prefill_log_tail.count(STOCK_LINES[side])
        counted = releases.features().mooncake_aux_count_check
        if n != (1 if counted else 0):
            return f"expected stock's registration line {STOCK_LINES[side]!r} {1 if counted else 0} times, found {n}"
        if not counted and side == "decode":
            for r in result.requests:
                if r.prefill_status != "Failed" or r.decode_status != "Failed":
                    return (f"request {r.index}: stock's transfer thread dies, both sides Failed; got "
                            f"prefill={r.prefill_status} decode={r.decode_status}")
            if not any("list index out of range" in t for r in result.requests for t in r.thread_errors):
                return "no prefill thread died on 'list index out of range' (send_aux indexing prefill's row sizes)"
            return None
        for r in result.requests:
            if not r.ok:
                return (f"request {r.index}: stock serves the pair (Success, bytes as verified); got "
                        f"prefill={r.prefill_status} decode={r.decode_status} mismatches={r.mismatches[:3]}")
        return None

    return check


def _row_size_signature(result, policy) -> Optional[str]:
    """Stock, every release: both requests Success on both sides, decode's bytes wrong in the
    hidden-state buffer only (its row never written, prefill's row elsewhere in it)."""
    for r in result.requests:
        if r.prefill_status != "Success" or r.decode_status != "Success":
            return f"request {r.index}: stock reports Success on both sides; got {r.prefill_status}/{r.decode_status}"
        if not r.mismatches:
            return f"request {r.index}: stock's hidden-state row should be misplaced, but every byte is right"
        other = [m for m in r.mismatches if not m.startswith((HIDDEN_STATES_LABEL + " ", HIDDEN_STATES_LABEL + ":"))]
        if other:
            return f"request {r.index}: mismatches outside the hidden-state buffer: {other[:3]}"
    return None


ROW_SIZE = BuiltinScenario(
    "hidden-state rows larger on decode",
    "F9",
    "decode's hidden-state metadata rows twice prefill's (speculative decoding on one side only; stock: "
    "Success with the row misplaced, ext: refused at registration)",
    lambda policy: hidden_rows_differ(),
    passed=lambda result: refusal_problem(result, ROW_SIZE_REFUSAL) is None,
    signature=_row_size_signature,
    stock_reports_success=lambda: True,
)


def _row(side: str) -> BuiltinScenario:
    def passed(result) -> bool:
        return refusal_problem(result, REFUSALS[side]) is None

    return BuiltinScenario(
        f"kv checksum on {side} only",
        "F9",
        f"the KV-checksum metadata buffer on {side} only (stock: served, metadata paired by position; "
        "ext: refused at registration)",
        lambda policy, side=side: checksum_on(side),
        passed=passed,
        signature=_signature(side),
        buildable=lambda: releases.features().metadata_buffers_kv_checksum,
        # 0.5.21-0.5.22 with the checksum on decode: stock's thread dies and both sides wait out.
        stock_reports_success=lambda side=side: side == "prefill" or releases.features().mooncake_aux_count_check,
    )


# The checksum rows where MetadataBuffers has that buffer (0.5.21+); the row-size one everywhere.
CHECKSUM_SCENARIOS = [_row("decode"), _row("prefill")]
SCENARIOS = CHECKSUM_SCENARIOS + [ROW_SIZE]
