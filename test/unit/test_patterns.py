"""The harness's expected-value derivation, checked against hand-written tables.

Nothing here imports SGLang or torch: the scenario and the patterns are pure.
"""

import json
import pathlib

import numpy as np
import pytest

from sglang_disagg_ext.selftest.harness import patterns
from sglang_disagg_ext.selftest.harness.scenario import (
    AUX_POOL_ID,
    KV_POOL_ID,
    STATE_POOL_BASE,
    KVPoolSpec,
    RequestSpec,
    Scenario,
    ScenarioError,
    StatePoolSpec,
    StateSpec,
)

pytestmark = pytest.mark.timeout(30)

# -- page pairing (F1's rule: leading entries pair up, the rest is left alone) --

PAIR_TABLE = [
    # src, dst, expected pairs
    ([1, 2, 3], [7, 8, 9], [(1, 7), (2, 8), (3, 9)]),
    ([1, 2, 3, 4, 5], [7, 8, 9], [(1, 7), (2, 8), (3, 9)]),  # prefill longer: its tail is dropped
    ([1, 2], [7, 8, 9], [(1, 7), (2, 8)]),  # decode longer: page 9 untouched
    ([], [7, 8], []),
    ([3], [], []),
    ([], [], []),
    (None, [1, 2], []),
    ([1, 2], None, []),
    ([5, 1], [0, 9], [(5, 0), (1, 9)]),  # order is kept, not sorted
]


@pytest.mark.parametrize("src,dst,want", PAIR_TABLE)
def test_aligned_pairs(src, dst, want):
    assert patterns.aligned_pairs(src, dst) == want


MAMBA_TABLE = [
    ([2], [5], [(2, 5)]),
    ([2, 3], [5], []),
    ([2], [5, 6], []),
    ([], [5], []),
    (None, [5], []),
]


@pytest.mark.parametrize("src,dst,want", MAMBA_TABLE)
def test_mamba_pairs(src, dst, want):
    assert patterns.mamba_pairs(src, dst) == want


# -- expected decode contents after each request -------------------------------


def _two_request_scenario():
    return Scenario(
        name="table",
        page_size=4,
        kv=KVPoolSpec(num_pages=8),
        aux_rows=4,
        state_pools=[StatePoolSpec("swa", num_pages=6), StatePoolSpec("mamba", num_pages=3)],
        requests=[
            RequestSpec(
                src_kv_pages=[1, 2, 3],
                dst_kv_pages=[4, 5],
                aux_index=0,
                dst_aux_index=2,
                state=[StateSpec("swa", [1, 2], [3, 4, 5]), StateSpec("mamba", [0], [2])],
            ),
            RequestSpec(
                src_kv_pages=[6],
                dst_kv_pages=[7, 1],
                aux_index=3,
                state=[StateSpec("swa", [0, 1, 2, 3, 4], [0, 1]), StateSpec("mamba", [1, 2], [0])],
            ),
        ],
    )


def test_expected_after_first_request():
    scn = _two_request_scenario()
    exp = patterns.expected_after_request(scn, 0)
    kv, aux = exp[KV_POOL_ID], exp[AUX_POOL_ID]
    swa, mamba = exp[STATE_POOL_BASE], exp[STATE_POOL_BASE + 1]
    assert kv.writes == {4: 1, 5: 2}
    assert kv.sentinel_pages == [0, 1, 2, 3, 6, 7]
    assert aux.writes == {2: 0}
    assert aux.sentinel_pages == [0, 1, 3]
    assert swa.writes == {3: 1, 4: 2}
    assert swa.sentinel_pages == [0, 1, 2, 5]  # decode's extra page 5 keeps the sentinel
    assert mamba.writes == {2: 0}
    assert mamba.sentinel_pages == [0, 1]
    assert (swa.name, mamba.name) == ("state0:swa", "state1:mamba")


def test_expected_after_second_request_keeps_earlier_pages():
    scn = _two_request_scenario()
    exp = patterns.expected_after_request(scn, 1)
    kv, aux = exp[KV_POOL_ID], exp[AUX_POOL_ID]
    swa, mamba = exp[STATE_POOL_BASE], exp[STATE_POOL_BASE + 1]
    assert kv.writes == {7: 6}
    # 4 and 5 still hold request 0's prefill pages 1 and 2; page 1 is listed by
    # request 1 but not moved (1 src page), so it keeps the sentinel
    assert kv.kept == {4: (0, 1), 5: (0, 2)}
    assert kv.sentinel_pages == [0, 1, 2, 3, 6]
    assert aux.writes == {3: 3}  # dst_aux_index defaults to aux_index
    assert aux.kept == {2: (0, 0)}
    assert aux.sentinel_pages == [0, 1]
    assert swa.writes == {0: 0, 1: 1}
    assert swa.kept == {3: (0, 1), 4: (0, 2)}
    assert swa.sentinel_pages == [2, 5]
    assert mamba.writes == {}  # two prefill slots: nothing moves
    assert mamba.kept == {2: (0, 0)}
    assert mamba.sentinel_pages == [0, 1]


def test_pages_of_an_earlier_request_decode_does_not_hold_are_not_checked():
    scn = _two_request_scenario()
    exp = patterns.expected_after_request(scn, 1, held=set())  # request 0 ended Failed
    assert all(e.kept == {} for e in exp.values())
    assert exp[KV_POOL_ID].writes == {7: 6}
    assert exp[KV_POOL_ID].sentinel_pages == [0, 1, 2, 3, 6]  # 4, 5: whatever request 0 left


def _three_request_kv():
    # r0: prefill 0, 1 -> decode 2, 3; r1: prefill 4 -> decode 3 (rewrites r0's page 3);
    # r2: prefill 5 -> decode 0.
    return Scenario(name="three", kv=KVPoolSpec(num_pages=6), requests=[
        RequestSpec([0, 1], [2, 3]), RequestSpec([4], [3]), RequestSpec([5], [0])])


@pytest.mark.parametrize(
    "held, kept",
    [
        (None, {2: (0, 0), 3: (1, 4)}),  # every earlier request held: page 3 is r1's now
        ({0, 1}, {2: (0, 0), 3: (1, 4)}),
        ({0}, {2: (0, 0)}),  # r1 failed: its page 3 holds nothing derivable, r0's 2 still checked
        ({1}, {3: (1, 4)}),  # r0 failed; r1 rewrote page 3 after it
        (set(), {}),
    ],
)
def test_kept_pages_follow_the_last_writer(held, kept):
    exp = patterns.expected_after_request(_three_request_kv(), 2, held)[KV_POOL_ID]
    assert exp.writes == {0: 5}
    assert exp.kept == kept
    assert exp.sentinel_pages == [1, 4, 5]


def _kv_buffer_after_three(item=48):
    """Decode KV buffer 0 after the three requests, every one held, built by hand."""
    buf = patterns.sentinel_buffer(6, item)
    buf[2] = patterns.page_bytes(KV_POOL_ID, 0, 0, item)  # r0
    buf[3] = patterns.page_bytes(KV_POOL_ID, 0, 4, item)  # r1 over r0
    buf[0] = patterns.page_bytes(KV_POOL_ID, 0, 5, item)  # r2
    return buf


def test_compare_accepts_earlier_requests_pages():
    exp = patterns.expected_after_request(_three_request_kv(), 2)[KV_POOL_ID]
    assert patterns.compare_buffer(_kv_buffer_after_three(), KV_POOL_ID, 0, exp, "kv buffer 0") == []


def test_compare_catches_a_stray_write_into_an_earlier_requests_page():
    exp = patterns.expected_after_request(_three_request_kv(), 2)[KV_POOL_ID]
    buf = _kv_buffer_after_three()
    buf[2] = patterns.page_bytes(KV_POOL_ID, 0, 5, 48)  # r2's page landed on r0's page 2 too
    buf[3, 7] ^= 0xFF  # and one byte of r1's page 3 went wrong
    problems = patterns.compare_buffer(buf, KV_POOL_ID, 0, exp, "kv buffer 0")
    assert len(problems) == 2, problems
    assert problems[0].startswith(
        "kv buffer 0 page 2: must still hold request 0's bytes (prefill page 0), found prefill page 5's bytes ("
    ), problems
    assert problems[1].startswith(
        "kv buffer 0 page 3: must still hold request 1's bytes (prefill page 4), found unrecognised bytes"
    ) and problems[1].endswith("(1/48 bytes differ, first at offset 7)"), problems


def test_compare_rank_buffer_catches_a_stray_write_into_an_earlier_requests_page():
    page_size, h, hb = 2, 2, 8
    kw = dict(num_layers=1, page_size=page_size, total_heads=h, head_bytes=hb, heads=[1], dtype_size=2,
              label="decode rank 1 kv buffer 0")
    exp = patterns.expected_after_request(_three_request_kv(), 2)[KV_POOL_ID]
    buf = patterns.sentinel_buffer(6, page_size * hb)
    for dst, src in ((2, 0), (3, 4), (0, 5)):
        buf[dst] = patterns.kv_rank_pages(0, [src], page_size, h, hb, [1])[0]
    assert patterns.compare_kv_rank_buffer(buf, 0, exp, **kw) == []
    buf[2] = patterns.SENTINEL  # r0's page 2 wiped
    assert patterns.compare_kv_rank_buffer(buf, 0, exp, **kw) == [
        "decode rank 1 kv buffer 0 (K layer 0) page 2: must still hold request 0's bytes (prefill page 0), "
        "found the sentinel (16/16 bytes differ, first at offset 0)"]


def test_repeated_decode_page_last_write_wins():
    scn = Scenario(name="dup", kv=KVPoolSpec(num_pages=4), requests=[RequestSpec([1, 2], [3, 3])])
    assert patterns.expected_after_request(scn, 0)[KV_POOL_ID].writes == {3: 2}


# -- byte patterns -----------------------------------------------------------


def test_pattern_is_deterministic_and_never_the_sentinel():
    a = patterns.buffer_pattern(0, 1, 64, 512)
    b = patterns.buffer_pattern(0, 1, 64, 512)
    assert a.dtype == np.uint8 and a.shape == (64, 512)
    assert np.array_equal(a, b)
    assert not np.any(a == patterns.SENTINEL)
    for page in (0, 7, 63):
        assert np.array_equal(a[page], patterns.page_bytes(0, 1, page, 512))


def test_pattern_distinguishes_pool_buffer_and_page():
    base = patterns.page_bytes(0, 0, 0, 64)
    for other in (
        patterns.page_bytes(1, 0, 0, 64),
        patterns.page_bytes(0, 1, 0, 64),
        patterns.page_bytes(0, 0, 1, 64),
    ):
        assert not np.array_equal(base, other)
    pages = patterns.buffer_pattern(2, 3, 256, 32)
    assert len({row.tobytes() for row in pages}) == 256


# -- comparison --------------------------------------------------------------


def _decode_buffer_after(scn, index, pool_id, buffer, item):
    """Build by hand what a correct decode buffer looks like after request ``index``."""
    exp = patterns.expected_after_request(scn, index)[pool_id]
    buf = patterns.sentinel_buffer(exp.num_pages, item)
    for dst, src in exp.writes.items():
        buf[dst] = patterns.page_bytes(pool_id, buffer, src, item)
    return exp, buf


def test_compare_accepts_a_correct_buffer():
    scn = _two_request_scenario()
    exp, buf = _decode_buffer_after(scn, 0, KV_POOL_ID, 2, 48)
    assert patterns.compare_buffer(buf, KV_POOL_ID, 2, exp, "kv buffer 2") == []


def test_compare_reports_missing_misplaced_and_stray_pages():
    scn = _two_request_scenario()
    exp, buf = _decode_buffer_after(scn, 0, KV_POOL_ID, 0, 48)
    buf[4] = patterns.SENTINEL  # never written
    buf[5] = patterns.page_bytes(KV_POOL_ID, 0, 3, 48)  # wrong source page
    buf[7] = patterns.page_bytes(KV_POOL_ID, 0, 3, 48)  # stray write to an untouched page
    problems = patterns.compare_buffer(buf, KV_POOL_ID, 0, exp, "kv buffer 0")
    assert len(problems) == 3, problems
    assert "page 4" in problems[0] and "sentinel" in problems[0]
    assert "page 5" in problems[1] and "expected prefill page 2" in problems[1] and "prefill page 3's" in problems[1]
    assert "page 7" in problems[2] and "untouched" in problems[2]


def test_compare_reports_bytes_from_another_buffer_as_unrecognised():
    scn = _two_request_scenario()
    exp, buf = _decode_buffer_after(scn, 0, KV_POOL_ID, 0, 48)
    buf[4] = patterns.page_bytes(KV_POOL_ID, 1, 1, 48)  # the right page of the wrong layer
    (problem,) = patterns.compare_buffer(buf, KV_POOL_ID, 0, exp, "kv buffer 0")
    assert "unrecognised" in problem


def test_compare_caps_the_report():
    scn = Scenario(name="big", kv=KVPoolSpec(num_pages=40), requests=[RequestSpec(list(range(20)), list(range(20, 40)))])
    exp = patterns.expected_after_request(scn, 0)[KV_POOL_ID]
    problems = patterns.compare_buffer(patterns.sentinel_buffer(40, 16), KV_POOL_ID, 0, exp, "kv")
    assert len(problems) == patterns.MAX_MISMATCHES_PER_BUFFER + 1
    assert "12 more" in problems[-1]


# -- scenario ---------------------------------------------------------------


def test_scenario_json_round_trip():
    scn = _two_request_scenario()
    back = Scenario.from_json(json.dumps(json.loads(scn.to_json())))
    assert back == scn
    assert back.room_of(1) == scn.room_base + 1


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda s: s.requests[0].src_kv_pages.append(8), "not in [0, 8)"),
        (lambda s: s.requests[0].state.pop(), "lists 1 state components"),
        (lambda s: setattr(s.requests[0].state[0], "kind", "nsa"), "is 'nsa', pool 0 is 'swa'"),
        (lambda s: setattr(s.requests[1], "room", s.room_base), "reuses bootstrap room"),
        (lambda s: setattr(s.requests[0], "dst_aux_index", 4), "dst_aux_index 4"),
        (lambda s: s.state_pools.append(StatePoolSpec("gdn")), "unknown kind"),
    ],
)
def test_scenario_validation(mutate, message):
    scn = _two_request_scenario()
    mutate(scn)
    with pytest.raises(ScenarioError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        scn.validate()


def test_none_state_lists_are_expressible():
    scn = _two_request_scenario()
    scn.requests[0].state[0] = StateSpec("swa", None, [1])
    scn.validate()
    assert patterns.expected_after_request(scn, 0)[STATE_POOL_BASE].writes == {}


def test_patterns_do_not_import_code_under_test():
    src = pathlib.Path(patterns.__file__).read_text()
    assert "sglang_disagg_ext.core" not in src and "import sglang" not in src
