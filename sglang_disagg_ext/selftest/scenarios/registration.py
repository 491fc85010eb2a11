"""F9 scenarios: one side builds its metadata buffers with the KV-checksum buffer, the other without.

The harness builds SGLang's real ``MetadataBuffers`` on each side, on one
side with ``kv_checksum_enabled=True`` (what ``--disaggregation-enable-kv-checksum``
passes; ``Scenario.kv_checksum_on``): that side registers one more metadata
buffer, the last. Two requests to the same decode follow.

Stock 0.5.23 logs the difference at registration ("registered 11 metadata
buffers but this prefill has 10; only the first 10 are transferred ...") and
serves the pair: both requests Success, the shared buffers right, and
decode's checksum buffer never written (decode enabled checksums and gets
none). ``-ext``: the decode session is refused at registration; every request
ends Failed on both sides within a bound with a reason naming both counts and
the differing row sizes, and nothing is written to decode (KV pages and
metadata rows all still the sentinel).

Expected texts are written out by hand. 0.5.23's metadata buffers with the
harness's geometry (hidden size 64, bfloat16; sampling mask and DSA top-k off),
bytes per row: output_ids 16 x int32 = 64, cached_tokens 64, output token
logprob value and index 64 each, top logprobs value and index 128 x 4 = 512
each, top-k p 16 x fp32 = 64, top-k index 16 x int64 = 128, hidden states 64 x
bf16 = 128, bootstrap room 8 x uint64 = 64: ten buffers. The KV checksum is an
eleventh, 8 x uint64 = 64 bytes per row.
"""

from __future__ import annotations

from typing import Optional

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
    """Stock 0.5.23: one ERROR line at registration naming both counts, then both requests
    Success on both sides with every byte the verifier checks right (the shared buffers; with
    the checksum on decode, its checksum row still the sentinel: never sent)."""

    def check(result, policy) -> Optional[str]:
        # The log tail, not the per-request logs: the registration may come
        # before prefill's first request starts its log window.
        n = result.prefill_log_tail.count(STOCK_LINES[side])
        if n != 1:
            return f"expected stock's one registration line {STOCK_LINES[side]!r}, found {n}"
        for r in result.requests:
            if not r.ok:
                return (f"request {r.index}: stock serves the pair (Success, bytes as verified); got "
                        f"prefill={r.prefill_status} decode={r.decode_status} mismatches={r.mismatches[:3]}")
        return None

    return check


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
    )


SCENARIOS = [_row("decode"), _row("prefill")]
