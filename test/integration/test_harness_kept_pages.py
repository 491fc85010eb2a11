"""The harness checks earlier requests' pages after every request (``harness/patterns.py``:
``expected_after_request``'s ``kept`` pages), end to end through the real worker.

Stock Mooncake over TCP on 127.0.0.1, CPU pools. Three requests; right after request 2's
transfer, the harness's decode hook (``test/support/tamper.py``, only for that request)
flips byte 0 of decode KV page 4, which request 0 wrote and neither later request targets:
a stray write into another request's page, the class of F4's and F6's. Before the check
followed the last writer of each page, no page of request 0 was looked at again.
"""

import importlib.util
import os

import pytest
from conftest import required_part

from sglang_disagg_ext.selftest.harness import KVPoolSpec, RequestSpec, Scenario, run_scenario

pytestmark = [
    pytest.mark.engine,
    required_part("Mooncake", importlib.util.find_spec("mooncake") is not None, "mooncake transfer engine not installed"),
]

TAMPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support", "tamper.py")


@pytest.mark.timeout(270)
def test_a_stray_write_into_an_earlier_requests_page_is_seen():
    # r0: prefill KV 1, 2 -> decode 4, 5; r1: 3 -> 5 (rewrites r0's page 5); r2: 6 -> 7.
    # After r2 decode page 4 must still hold prefill page 1 (r0's), page 5 prefill page 3 (r1's).
    scn = Scenario(name="kept pages", kv=KVPoolSpec(num_pages=8), aux_rows=4, requests=[
        RequestSpec([1, 2], [4, 5], aux_index=0, dst_aux_index=1),
        RequestSpec([3], [5], aux_index=1, dst_aux_index=2),
        RequestSpec([6], [7], aux_index=2, dst_aux_index=3),
    ])
    env = {"SGLANG_HARNESS_DECODE_HOOK": f"{TAMPER}:flip_one_byte", "SGLANG_HARNESS_TAMPER": "kv:4",
           "SGLANG_HARNESS_TAMPER_REQUEST": "2"}
    res = run_scenario(scn, "mooncake", timeout_s=240, extra_env=env)
    assert [(r.prefill_status, r.decode_status) for r in res.requests] == [("Success", "Success")] * 3, \
        res.describe()
    assert [r.mismatches for r in res.requests[:2]] == [[], []], res.describe()
    # Page rows: 2 layers' K then V buffers, buffer 0 is K of layer 0; byte 0 of its page 4.
    (line,) = res.requests[2].mismatches
    assert line.startswith("kv buffer 0 page 4: must still hold request 0's bytes (prefill page 1), found "), line
    assert "(1/" in line and line.endswith(" bytes differ, first at offset 0)"), line
    assert not res.requests[2].bytes_verified
