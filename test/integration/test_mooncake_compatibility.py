"""F18 on the real Mooncake engine (TCP, 127.0.0.1): a decode whose KV pages are laid out otherwise is refused.

Two processes through the transfer harness: SGLang's real bootstrap server, managers, senders and
receivers, CPU tensors as pools (SGLang's own ``MHATokenToKVPool``), a real Mooncake TransferEngine;
decode checks every destination page and row byte for byte and that every other one still holds its
sentinel.

Injection: decode builds its KV pool with head dim 32 where prefill's has 16
(``Scenario.decode_kv_head_dim``): a decode started with another model configuration, as in a rolling
upgrade that reached one pool only. Nothing in SGLang or the plugin is replaced.

Expected values, by hand: page size 4 tokens, 2 KV heads, bfloat16 (2 bytes): prefill's KV pages are
4 x 2 x 16 x 2 = 256 bytes per layer buffer, decode's 4 x 2 x 32 x 2 = 512. Stock writes decode page
``i`` at ``i x 256``: request 0's pages 3 and 4 land in the second half of decode's page 1 and the first
half of page 2 (1 x 512 + 256, 2 x 512); its own pages 3 and 4 are never written.
"""

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.selftest.harness.run import run_scenario
from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario
from sglang_disagg_ext.selftest.scenarios.registration import refusal_problem

pytestmark = pytest.mark.engine

POLICY = releases.current_policy()
live_only = pytest.mark.skipif(not POLICY.is_live("F18"), reason=f"F18 is not live on SGLang {POLICY.version}")

REASON = (
    "cannot be served: its KV cache layout differs from this prefill's (KV bytes per page of a layer buffer "
    "(attention TP 1 on both sides): prefill [256], decode [512]): the two servers run different model "
    f"configurations; decode runs SGLang {POLICY.version}, sglang-disagg-ext "
)
REFUSED_LINE = "refused at registration, every request to it ends Failed"
# Request 0 on stock (module docstring): its pages never written, and halves of two pages no request
# targeted written, in every layer buffer (2 layers: K and V of each).
STOCK_TARGETS_UNWRITTEN = ("page 3: expected prefill page 1's bytes, found the sentinel",
                           "page 4: expected prefill page 2's bytes, found the sentinel")
STOCK_STRAYS = ("page 1: must be untouched, found unrecognised bytes (256/512 bytes still sentinel)",
                "page 2: must be untouched, found unrecognised bytes (256/512 bytes still sentinel)")


def _scenario() -> Scenario:
    return Scenario(
        name="decode KV head dim 32, prefill 16",
        requests=[
            RequestSpec([1, 2], [3, 4], aux_index=1, dst_aux_index=2),
            RequestSpec([5], [6], aux_index=3, dst_aux_index=4),
        ],
        kv=KVPoolSpec(num_pages=8, head_num=2, head_dim=16),
        page_size=4,
        decode_kv_head_dim=32,
    )


@live_only
@pytest.mark.timeout(300)
def test_stock_writes_another_layout_at_wrong_offsets_ext_refuses_at_registration():
    """Stock: both requests Success on both sides; request 0's targeted pages never written and half
    of two pages no request targeted overwritten, in each of the four layer buffers. Ext: one ERROR at registration naming both page sizes and both
    sides' release and plugin version; each request Failed on both sides within the bound with that
    reason; no page or row of decode written."""
    stock = run_scenario(_scenario(), "mooncake")
    assert stock.error is None and len(stock.requests) == 2, stock.describe()
    for r in stock.requests:
        assert (r.prefill_status, r.decode_status) == ("Success", "Success"), stock.describe()
    first = stock.requests[0].mismatches
    for b in range(4):
        for text in STOCK_TARGETS_UNWRITTEN + STOCK_STRAYS:
            assert any(m.startswith(f"kv buffer {b} {text}") for m in first), (
                f"request 0: expected 'kv buffer {b} {text}'\n{stock.describe()}")

    ext = run_scenario(_scenario(), "mooncake-ext")
    problem = refusal_problem(ext, REASON)
    assert problem is None, f"{problem}\n{ext.describe()}"
    assert ext.prefill_log_tail.count(REFUSED_LINE) == 1, ext.prefill_log_tail
