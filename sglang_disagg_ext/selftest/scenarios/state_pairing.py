"""F7 scenarios: decode's paged state pool has draft (MTP/nextn) layers at its tail.

One request: KV pages 1, 2 -> 5, 6, aux row 2 -> 5, state pages 2, 3, 4 ->
9, 10, 11 (equal lengths, so F1 plays no part). Prefill's state pool has
``n`` layers, decode's ``n + extra``; prefill layer L belongs in decode layer
L and decode's extra layers keep their sentinel (``patterns.source_buffer``).

Stock's pairing (``get_mha_kv_ptrs_with_pp``, 0.5.10.post1-0.5.23), worked by
hand: with ``m = n + extra`` decode layers and ``m % n != 0`` it takes decode
for ``[K_main, V_main, K_draft, V_draft]``: prefill K L -> decode K L (right),
prefill V L -> decode buffer ``n * (m // n) + L``. Decode's buffers are K0 ..
K(m-1), V0 .. V(m-1), so for extra < n that is decode K(n+L) (a draft layer)
while n + L < m, else decode V(L - extra). Where ``m % n == 0`` (n = 1, or
n = 2 with two extra) stock's guess happens to pair correctly; those cases are
controls in the tests, not rows here.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, StatePoolSpec, StateSpec
from sglang_disagg_ext.selftest.scenarios.mooncake import STOCK_SERVES_TIMEOUTS, BuiltinScenario

SRC_PAGES = [2, 3, 4]
DST_PAGES = [9, 10, 11]

# (prefill layers n, decode extra layers) -> {decode buffer: (prefill buffer it must
# hold or None for a draft layer, prefill buffer stock writes there or None)}, for
# every decode buffer stock gets wrong. Decode buffer b is K layer b for b < m,
# else V layer b - m; prefill buffer p is K layer p for p < n, else V layer p - n.
STOCK_WRONG: Dict[Tuple[int, int], Dict[int, Tuple[Optional[int], Optional[int]]]] = {
    # m = 3: decode K0 K1 K2 V0 V1 V2 = 0..5; prefill V0 (2) -> K2, V1 (3) -> V0.
    (2, 1): {2: (None, 2), 3: (2, 3), 4: (3, None)},
    # m = 5: decode K0..K4 = 0..4, V0..V4 = 5..9; prefill V0..V3 (4..7) -> K4, V0, V1, V2.
    (4, 1): {4: (None, 4), 5: (4, 5), 6: (5, 6), 7: (6, 7), 8: (7, None)},
    # m = 6: decode K0..K5 = 0..5, V0..V5 = 6..11; prefill V0..V3 (4..7) -> K4, K5, V0, V1.
    (4, 2): {4: (None, 4), 5: (None, 5), 6: (4, 6), 7: (5, 7), 8: (6, None), 9: (7, None)},
}


def tail_layers(kind: str, n: int, extra: int) -> Scenario:
    """One request; prefill's ``kind`` pool has ``n`` layers, decode's ``n + extra``.

    Every run of it, stock or -ext, patched or not, serves Success on both sides, so SGLang's
    waiting bound is never waited out and costs nothing when long: the default 8 s was passed
    once on a loaded CI machine (0.5.23, -n 4: an 8.1 s transfer, decode failed the room)."""
    return Scenario(
        timeouts=STOCK_SERVES_TIMEOUTS,
        name=f"{kind} {n} layers, decode +{extra}",
        requests=[
            RequestSpec(
                src_kv_pages=[1, 2],
                dst_kv_pages=[5, 6],
                aux_index=2,
                dst_aux_index=5,
                state=[StateSpec(kind, list(SRC_PAGES), list(DST_PAGES))],
            )
        ],
        kv=KVPoolSpec(num_pages=8),
        state_pools=[StatePoolSpec(kind=kind, num_pages=12, num_layers=n, decode_extra_layers=extra)],
    )


_BYTES_DIFFER = re.compile(r" \(\d+/\d+ bytes differ, first at offset \d+\)$")


def expected_stock_mismatches(kind: str, n: int, extra: int) -> set:
    """The decode verifier's lines for stock's pairing of ``(n, extra)`` (STOCK_WRONG)."""
    out = set()
    for b, (want, got) in STOCK_WRONG[(n, extra)].items():
        found = "the sentinel (never written)" if got is None else "prefill buffer {got} page {s}'s bytes"
        for s, d in zip(SRC_PAGES, DST_PAGES):
            what = found.format(got=got, s=s)
            if want is None:
                out.add(f"state0:{kind} buffer {b} page {d}: must be untouched, found {what}")
            else:
                out.add(f"state0:{kind} buffer {b} page {d}: expected prefill page {s}'s bytes, found {what}")
    return out


def _signature(kind: str, n: int, extra: int):
    """Stock: Success on both sides, no thread error, KV and aux right, and exactly the
    state buffers of ``STOCK_WRONG`` wrong (a draft layer written, V layers shifted)."""

    def check(result, policy) -> Optional[str]:
        r = result.requests[0]
        if r.prefill_status != "Success" or r.decode_status != "Success":
            return f"F7 reports Success on both sides; got prefill={r.prefill_status} decode={r.decode_status}"
        if r.thread_errors:
            return f"F7 raises nothing; got {r.thread_errors}"
        got = {_BYTES_DIFFER.sub("", m) for m in r.mismatches}
        want = expected_stock_mismatches(kind, n, extra)
        if got != want:
            return f"mismatches are not exactly stock's layer shift: missing {sorted(want - got)[:4]}, extra {sorted(got - want)[:4]}"
        return None

    return check


def _row(kind: str, n: int, extra: int) -> BuiltinScenario:
    return BuiltinScenario(
        f"{kind} {n} layers, decode +{extra}",
        "F7",
        f"decode's {kind} pool has {extra} draft layer(s) after prefill's {n} (stock: V buffers shifted into them)",
        lambda p, kind=kind, n=n, extra=extra: tail_layers(kind, n, extra),
        signature=_signature(kind, n, extra),
        stock_reports_success=lambda: True,
    )


SCENARIOS = [_row("swa", n, extra) for n, extra in sorted(STOCK_WRONG)] + [_row("nsa", 2, 1)]


def scenarios_for(policy: releases.ReleasePolicy):
    return [s for s in SCENARIOS if s.applies(policy)]
