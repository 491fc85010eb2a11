"""The flip tests' own check that a flip landed (``test/support/verify_cases.py``:
``assert_harness_saw_the_flip``), against the harness's real mismatch lines: decode pools
built by hand with one byte flipped, compared by ``harness/patterns.py`` as the worker does.
No SGLang, no engine."""

import pytest

from sglang_disagg_ext.selftest.harness import patterns
from sglang_disagg_ext.selftest.harness.run import RequestResult, ScenarioResult
from sglang_disagg_ext.selftest.harness.scenario import AUX_POOL_ID, KV_POOL_ID
from support.verify_cases import assert_harness_saw_the_flip, one_request

pytestmark = pytest.mark.timeout(30)

ITEM = 64  # bytes of a decode page in the hand-built pools


def _result(scn, mismatches):
    rr = RequestResult(index=0, room=scn.room_of(0), prefill_status="Success", decode_status="Success",
                       bytes_verified=not mismatches, mismatches=mismatches)
    return ScenarioResult(scn.name, "x", requests=[rr])


def _kv_buffer_1(flips=()):
    """Decode KV buffer 1 after one_request's KV 1-3 -> 6-8, right but for ``flips`` (page, byte)."""
    buf = patterns.sentinel_buffer(10, ITEM)
    for src, dst in ((1, 6), (2, 7), (3, 8)):
        buf[dst] = patterns.page_bytes(KV_POOL_ID, 1, src, ITEM)
    for page, byte in flips:
        buf[page, byte] ^= 0xFF
    return buf


def _lines(scn, buf):
    exp = patterns.expected_after_request(scn, 0)[KV_POOL_ID]
    return patterns.compare_buffer(buf, KV_POOL_ID, 1, exp, "kv buffer 1")


def test_the_flipped_byte_where_it_landed_passes():
    scn = one_request("t")
    assert_harness_saw_the_flip(_result(scn, _lines(scn, _kv_buffer_1([(7, 1)]))), scn, "kv", 1, 7)


@pytest.mark.parametrize(
    "flips",
    [
        [],  # the flip never landed: a Failed would be something else's
        [(6, 1)],  # another page
        [(7, 0)],  # another byte of the page
        [(7, 1), (7, 5)],  # two bytes wrong
        [(7, 1), (8, 3)],  # and another page wrong too
    ],
)
def test_anything_but_the_one_flipped_byte_fails(flips):
    scn = one_request("t")
    with pytest.raises(AssertionError):
        assert_harness_saw_the_flip(_result(scn, _lines(scn, _kv_buffer_1(flips))), scn, "kv", 1, 7)


def test_state_and_aux_pools_are_named_as_the_worker_names_them():
    # one_request(kind="swa"): state pages 2, 4 -> 5, 9; the worker calls that pool "state0:swa".
    scn = one_request("t", kind="swa")
    exp = patterns.expected_after_request(scn, 0)[patterns.STATE_POOL_BASE]
    buf = patterns.sentinel_buffer(12, ITEM)
    for src, dst in ((2, 5), (4, 9)):
        buf[dst] = patterns.page_bytes(exp.pool_id, 1, src, ITEM)
    buf[9, 1] ^= 0xFF
    lines = patterns.compare_buffer(buf, exp.pool_id, 1, exp, "state0:swa buffer 1")
    assert_harness_saw_the_flip(_result(scn, lines), scn, "state0", 1, 9)
    # aux row 1 -> 3
    exp = patterns.expected_after_request(scn, 0)[AUX_POOL_ID]
    rows = patterns.sentinel_buffer(8, ITEM)
    rows[3] = patterns.page_bytes(AUX_POOL_ID, 0, 1, ITEM)
    rows[3, 1] ^= 0xFF
    lines = patterns.compare_buffer(rows, AUX_POOL_ID, 0, exp, "aux buffer 0")
    assert_harness_saw_the_flip(_result(scn, lines), scn, "aux", 0, 3)


def _rank_lines(scn, flipped_ranks):
    """KV buffer 0 of each decode rank of one_request(1 -> 2): 4 heads of 8 bytes, page size 1,
    heads 0-1 on rank 0 and 2-3 on rank 1; byte 1 of page 8 flipped on ``flipped_ranks``. The
    lines as run.py hands them over (``decode<r>: ...``)."""
    exp = patterns.expected_after_request(scn, 0)[KV_POOL_ID]
    lines = []
    for rank, heads in ((0, [0, 1]), (1, [2, 3])):
        buf = patterns.sentinel_buffer(10, 2 * 8)
        for src, dst in ((1, 6), (2, 7), (3, 8)):
            buf[dst] = patterns.kv_rank_pages(0, [src], 1, 4, 8, heads)[0]
        if rank in flipped_ranks:
            buf[8, 1] ^= 0xFF
        lines += [f"decode{rank}: {m}" for m in patterns.compare_kv_rank_buffer(
            buf, 0, exp, num_layers=2, page_size=1, total_heads=4, head_bytes=8, heads=heads, dtype_size=2,
            label=f"decode rank {rank} kv buffer 0")]
    return lines


def test_several_decode_ranks_each_show_their_flip():
    scn = one_request("t", 1, 2)
    assert_harness_saw_the_flip(_result(scn, _rank_lines(scn, {0, 1})), scn, "kv", 0, 8)
    with pytest.raises(AssertionError):  # one rank's flip did not land
        assert_harness_saw_the_flip(_result(scn, _rank_lines(scn, {1})), scn, "kv", 0, 8)
