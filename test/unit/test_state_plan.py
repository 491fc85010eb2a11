"""F1/F2 planning logic on its own: hand-derived tables plus properties."""

import enum

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_disagg_ext.core.state_plan import (
    Route,
    StateTransferError,
    align_state_indices,
    check_paged_item_lens,
    plan_state_transfer,
    state_kind_name,
)


class FakeStateType(str, enum.Enum):  # the shape of SGLang 0.5.12's StateType
    MAMBA = "mamba"
    SWA = "swa"
    NSA = "nsa"


# (prefill pages, decode pages) -> (pages sent from, pages written to); written out by hand.
ALIGN_TABLE = [
    ([10, 11, 12, 13, 14], [3, 4, 5], [10, 11, 12], [3, 4, 5]),  # prefill longer (stock 0.5.10: crash)
    ([7, 8, 9], [20, 21], [7, 8], [20, 21]),
    ([7, 8], [20, 21, 22, 23], [7, 8], [20, 21]),  # decode longer (stock 0.5.10: no-op slice)
    ([1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6]),
    ([], [4, 5], [], []),
    ([9], [], [], []),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("src,dst,want_src,want_dst", ALIGN_TABLE)
def test_align_table(src, dst, want_src, want_dst):
    src_copy, dst_copy = list(src), list(dst)
    got_src, got_dst = align_state_indices(src, dst)
    assert got_src.tolist() == want_src
    assert got_dst.tolist() == want_dst
    assert got_src.dtype == np.int32 and got_dst.dtype == np.int32
    assert src == src_copy and dst == dst_copy


@pytest.mark.timeout(10)
def test_align_never_aliases_numpy_input():
    src = np.array([1, 2, 3], dtype=np.int32)
    dst = np.array([4, 5, 6], dtype=np.int32)
    a, b = align_state_indices(src, dst)
    a[0] = 99
    b[0] = 99
    assert src.tolist() == [1, 2, 3] and dst.tolist() == [4, 5, 6]


@pytest.mark.timeout(10)
def test_plan_two_components_hand_table():
    # Component 0 Mamba slot 3 -> slot 0; component 1 SWA, 5 prefill pages vs 3 decode pages.
    plans = plan_state_transfer(
        [FakeStateType.MAMBA, FakeStateType.SWA],
        [[3], [10, 11, 12, 13, 14]],
        [[0], [30, 31, 32]],
    )
    assert [(p.component, p.kind, p.route) for p in plans] == [
        (0, "mamba", Route.SINGLE_SLOT),
        (1, "swa", Route.PAGED),
    ]
    assert plans[0].src.tolist() == [3] and plans[0].dst.tolist() == [0]
    assert plans[1].src.tolist() == [10, 11, 12] and plans[1].dst.tolist() == [30, 31, 32]
    assert plans[1].trimmed and (plans[1].src_len, plans[1].dst_len) == (5, 3)
    text = plans[1].describe_trim()
    assert "component 1 (swa)" in text and "=5" in text and "=3" in text


@pytest.mark.timeout(10)
def test_dsv4_is_paged_on_flat_layout():
    (plan,) = plan_state_transfer(["dsv4"], [[4, 5]], [[8, 9]])
    assert plan.route is Route.PAGED
    assert plan.src.tolist() == [4, 5] and plan.dst.tolist() == [8, 9]


@pytest.mark.timeout(10)
def test_missing_and_none_components_are_skipped():
    plans = plan_state_transfer(["swa", "nsa", "none"], [None], [[1], [2], [3]])
    assert [p.route for p in plans] == [Route.SKIP, Route.SKIP, Route.SKIP]


@pytest.mark.timeout(10)
def test_unknown_state_type_is_an_error_naming_the_component():
    with pytest.raises(StateTransferError, match=r"component 1: unknown state type 'lightning'"):
        plan_state_transfer(["swa", "lightning"], [[1], [2]], [[1], [2]])


@pytest.mark.timeout(10)
@pytest.mark.parametrize("src,dst", [([1, 2], [0]), ([], [0]), ([1], []), ([1], [0, 1])])
def test_mamba_needs_one_slot_each_side(src, dst):
    with pytest.raises(StateTransferError, match=r"component 0 \(mamba\).*len\(prefill_state_indices\)="):
        plan_state_transfer(["mamba"], [src], [dst])


@pytest.mark.timeout(10)
def test_negative_index_is_an_error():
    with pytest.raises(StateTransferError, match="negative decode state index -1"):
        plan_state_transfer(["nsa"], [[1, 2]], [[0, -1]])


@pytest.mark.timeout(10)
def test_state_kind_name_accepts_enums_and_strings():
    assert state_kind_name(FakeStateType.NSA) == "nsa"
    assert state_kind_name("SWA") == "swa"
    assert state_kind_name(None) == "none"


@pytest.mark.timeout(10)
def test_item_len_check():
    check_paged_item_lens(0, "swa", [64, 64], [64, 64])
    check_paged_item_lens(0, "swa", [64, 64], [64, 64, 64])  # PP/MTP: pairing not decided here
    check_paged_item_lens(0, "dsv4", [64], [128])  # MTP: decode indexer entry larger by design
    with pytest.raises(StateTransferError, match=r"component 2 \(nsa\): buffer 1 entry size differs, prefill 64 bytes vs decode 32"):
        check_paged_item_lens(2, "nsa", [64, 64], [64, 32])


index_lists = st.one_of(st.none(), st.lists(st.integers(0, 2**31 - 1), max_size=40))


@pytest.mark.timeout(60)
@settings(max_examples=400, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["swa", "nsa", "dsv4", "none"]), max_size=5),
    src=st.lists(index_lists, max_size=6),
    dst=st.lists(index_lists, max_size=6),
)
def test_plan_properties(kinds, src, dst):
    src_before = [None if x is None else list(x) for x in src]
    dst_before = [None if x is None else list(x) for x in dst]
    plans = plan_state_transfer(kinds, src, dst)
    assert len(plans) == len(kinds)
    for i, plan in enumerate(plans):
        s = src[i] if i < len(src) else None
        d = dst[i] if i < len(dst) else None
        if kinds[i] == "none" or s is None:
            assert plan.route is Route.SKIP
            continue
        n = min(len(s), len(d or []))
        assert len(plan.src) == len(plan.dst) == n
        assert plan.src.tolist() == s[:n]
        assert plan.dst.tolist() == (d or [])[:n]
        assert plan.route is (Route.PAGED if n else Route.SKIP)
    # Inputs are never mutated.
    assert src == src_before and dst == dst_before
