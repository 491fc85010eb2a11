"""core.index_bounds: pool sizes from buffer lengths, the registration frame, the per-request check.

Every expected number is worked out by hand from the inputs in the test.
"""

import numpy as np
import pytest

from sglang_disagg_ext.core.index_bounds import (
    FRAME_PREFIX,
    IndexBoundsError,
    PoolBounds,
    bounds_in_message,
    bounds_of,
    check_destination,
    decode_frame,
    encode_frame,
    entries,
)

pytestmark = pytest.mark.timeout(30)


def test_entries_is_the_smallest_buffer():
    # 3072 // 256 = 12, 2560 // 256 = 10, 4096 // 512 = 8 -> 8
    assert entries([3072, 2560, 4096], [256, 256, 512], "kv") == 8
    # 1000 // 300 = 3 (a partial entry does not count)
    assert entries([1000], [300], "aux") == 3
    assert entries([], [], "kv") is None
    # 0.5.23's zero-row DSA index-share placeholders (length 0, item length 0) bound nothing:
    # 4096 // 512 = 8 from the one real buffer; only placeholders -> no bound.
    assert entries([0, 4096, 0], [0, 512, 0], "state component 1") == 8
    assert entries([0, 0], [0, 0], "state component 1") is None


@pytest.mark.parametrize(
    "lens, items, needle",
    [([100, 200], [10], "2 buffer lengths but 1 item lengths"), ([100], [0], "buffer 0: length 100, item length 0")],
)
def test_entries_refuses_what_gives_no_bound(lens, items, needle):
    with pytest.raises(IndexBoundsError, match=needle):
        entries(lens, items, "kv")


def test_bounds_of_kv_args_lists():
    # KV: 2 buffers of 12 pages x 256 B; aux: rows of 64 and 512 B, 8 each;
    # state: an SWA component of 8 pages x 128 B, a Mamba one of 5 and 4 slots.
    b = bounds_of([3072, 3072], [256, 256], [512, 4096], [64, 512], [[1024, 1024], [960, 256]], [[128, 128], [192, 64]])
    assert b == PoolBounds(kv=12, aux=8, state=(8, 4), aux_item_lens=(64, 512))


def test_frame_round_trip_and_foreign_frames():
    b = PoolBounds(kv=12, aux=None, state=(8, None))
    frame = encode_frame(b)
    assert frame.startswith(FRAME_PREFIX)
    assert decode_frame(frame) == b
    # Stock's last registration frame (packed kv_item_lens) is not ours.
    assert decode_frame(b"\x00\x01\x00\x00\x00\x00\x00\x00") is None
    assert bounds_in_message([b"None", b"127.0.0.1", b"1", b"s:1", frame]) == b
    assert bounds_in_message([b"None", b"127.0.0.1", b"1", b"s:1", b""]) is None
    # A verifying decode says so; a frame without the key (older -ext) reads as not.
    v = PoolBounds(kv=12, aux=None, state=(8, None), reads_digests=True)
    assert decode_frame(encode_frame(v)) == v
    assert decode_frame(FRAME_PREFIX + b'{"kv": 12, "aux": null, "state": []}').reads_digests is False
    assert decode_frame(FRAME_PREFIX + b'{"kv": 12, "digests": 1}').reads_digests is False  # only true counts


@pytest.mark.parametrize("tail", [b"{not json", b'{"kv": -1}', b'{"kv": true}', b'{"state": 3}'])
def test_malformed_frame_raises(tail):
    with pytest.raises(IndexBoundsError):
        decode_frame(FRAME_PREFIX + tail)


B = PoolBounds(kv=12, aux=8, state=(8, 5, 3))
KINDS = ("swa", "mamba", "swa_ring")


def test_in_pool_request_passes():
    assert check_destination(B, np.array([0, 5, 11], dtype=np.int32), 7, [[0, 7], [4], [2]], KINDS) is None


def test_kv_page_out_of_pool_names_position_and_size():
    assert check_destination(B, np.array([2, 40], dtype=np.int32), 0, [], KINDS) == (
        "kv: destination index 40 (position 1 of 2) outside decode's pool of 12 pages (valid 0..11)"
    )
    # one past the end, and negative, on a plain list
    assert "index 12 (position 0 of 1)" in check_destination(B, [12], 0, [], KINDS)
    assert "index -1 (position 2 of 3)" in check_destination(B, [1, 2, -1], 0, [], KINDS)


def test_aux_row_out_of_pool():
    assert check_destination(B, [1], 8, [], KINDS) == (
        "aux: destination index 8 outside decode's pool of 8 rows (valid 0..7)"
    )


def test_state_components_by_kind():
    assert check_destination(B, [1], 0, [[0, 1, 8], None, None], KINDS) == (
        "state component 0 (swa): destination index 8 (position 2 of 3) outside decode's pool of 8 entries "
        "(valid 0..7)"
    )
    assert check_destination(B, [1], 0, [None, [5], None], KINDS) == (
        "state component 1 (mamba): destination index 5 (position 0 of 1) outside decode's pool of 5 entries "
        "(valid 0..4)"
    )
    # swa_ring indices are ring slots, not entries: not checked.
    assert check_destination(B, [1], 0, [None, None, [99]], KINDS) is None


def test_unknown_bounds_are_not_checked():
    unknown = PoolBounds(kv=None, aux=None, state=(None,))
    assert check_destination(unknown, [999], 999, [[999]], ("swa",)) is None
    # a component decode published no bound for (beyond its list)
    assert check_destination(PoolBounds(kv=12, aux=8), [1], 0, [[999]], ("swa",)) is None


def test_first_problem_is_kv_then_aux_then_state():
    assert check_destination(B, [50], 9, [[9]], KINDS).startswith("kv:")
    assert check_destination(B, [1], 9, [[9]], KINDS).startswith("aux:")


# -- the harness opt-in the F6 scenarios use (scenario.RequestSpec.allow_out_of_pool) --


def test_out_of_pool_destination_needs_the_opt_in():
    from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, ScenarioError

    def scn(**kw):
        return Scenario(name="s", requests=[RequestSpec([1, 2], [2, 40], aux_index=0, dst_aux_index=9, **kw)],
                        kv=KVPoolSpec(num_pages=12))

    with pytest.raises(ScenarioError, match="dst_kv_pages: page 40 not in"):
        scn().validate()
    scn(allow_out_of_pool=True).validate()
    # the prefill side is never out of pool
    bad_src = Scenario(name="s", requests=[RequestSpec([12], [1], allow_out_of_pool=True)], kv=KVPoolSpec(num_pages=12))
    with pytest.raises(ScenarioError, match="src_kv_pages: page 12 not in"):
        bad_src.validate()


def test_expectation_skips_pages_decode_does_not_have():
    from sglang_disagg_ext.selftest.harness import patterns
    from sglang_disagg_ext.selftest.harness.scenario import KV_POOL_ID, KVPoolSpec, RequestSpec, Scenario

    scn = Scenario(name="s", requests=[RequestSpec([1, 2], [2, 40], allow_out_of_pool=True)], kv=KVPoolSpec(num_pages=12))
    kv = patterns.expected_after_request(scn, 0)[KV_POOL_ID]
    assert kv.writes == {2: 1}  # prefill page 2 -> decode page 40 names no decode page
    assert kv.sentinel_pages == [0, 1] + list(range(3, 12))
