"""F4 notification tags: the sender-field rewrite and the failure tag.

Expected tags are written out by hand from the layouts each release builds
(0.5.10.post1/0.5.11 ``add_transfer_request``, 0.5.12.x ``transfer_worker``
and ``_do_staging_transfer``); sender id = pp_rank * 65536 + engine_rank.
"""

import pytest

from sglang_disagg_ext.core.nixl_notif import (
    aux_room,
    FailureNotice,
    failure_tag,
    parse_failure_tag,
    with_sender_id,
)

REWRITES = [
    # (stock tag, pp_rank, engine_rank, expected)
    ("1000_kv_0_1_0", 0, 1, "1000_kv_0_1_1"),  # 0.5.11: pp_rank 0 in the field, TP rank 1 sends
    ("1000_kv_3_0_0", 0, 0, "1000_kv_3_0_0"),  # TP rank 0, PP 0: unchanged value
    ("1000_kv_0_1_1", 1, 1, "1000_kv_0_1_65537"),  # 0.5.12: TP rank in the field, stage 1
    ("7_kv_2_1", 0, 3, "7_kv_2_1_3"),  # no sender field: appended
    ("1000_state_0", 0, 1, "1000_state_1"),
    ("1000_state_1_0", 2, 1, "1000_state_131073_0"),  # 0.5.12 per-component state: suffix kept
    ("1000_state", 0, 2, "1000_state_2"),
    ("1000_aux_nokv_0", 0, 1, "1000_aux_nokv_1"),
    ("1000_aux", 1, 1, "1000_aux"),  # no sender: unchanged
    ("5_stg_0_1_1_3_16_4_agent_x_y", 1, 0, "5_stg_0_1_65536_3_16_4_agent_x_y"),
    ("5_fail_1_boom", 0, 1, "5_fail_1_boom"),  # ours: unchanged
    ("hello", 0, 1, "hello"),
    ("x_kv_0_1_0", 0, 1, "x_kv_0_1_0"),  # room not a number: not a tag
]


@pytest.mark.parametrize("tag,pp,tp,expected", REWRITES)
def test_with_sender_id(tag, pp, tp, expected):
    assert with_sender_id(tag, pp, tp) == expected
    assert with_sender_id(tag.encode("ascii"), pp, tp) == expected.encode("ascii")


def test_distinct_ranks_get_distinct_kv_keys():
    tags = {with_sender_id("9_kv_0_1_0", pp, tp) for pp in range(3) for tp in range(4)}
    assert len(tags) == 12


def test_non_ascii_bytes_pass_through():
    assert with_sender_id(b"\xff_kv", 0, 1) == b"\xff_kv"


def test_failure_tag_round_trip():
    tag = failure_tag(1001, 1, 2, "State index length mismatch: prefill=3, dst=2")
    assert tag == "1001_fail_65538_State index length mismatch: prefill=3, dst=2"
    assert parse_failure_tag(tag.encode()) == FailureNotice(1001, 65538, "State index length mismatch: prefill=3, dst=2")


def test_failure_reason_is_ascii_and_bounded():
    tag = failure_tag(1, 0, 0, "héllo\n" + "x" * 1000)
    assert tag.isascii() and "\n" not in tag
    assert len(tag) < 400
    assert parse_failure_tag(tag).reason.startswith("h?llo?")


@pytest.mark.parametrize("tag", ["1000_kv_0_1_0", "1000_aux", "1000_fail", "x_fail_1_r", "1_fail_x_r", b"\xff"])
def test_parse_failure_tag_ignores_other_tags(tag):
    assert parse_failure_tag(tag) is None


def test_failure_tag_rejects_bad_room():
    with pytest.raises(ValueError):
        failure_tag(-1, 0, 0, "r")


@pytest.mark.parametrize("tag,room", [
    (b"17_aux", 17), ("17_aux", 17), (b"17_aux_nokv_1", 17), (b"17_aux_3", 17),
    (b"17_kv_0_1_0", None), (b"17_fail_0_x", None), (b"x_aux", None), (b"aux", None), (b"\xff_aux", None),
])
def test_aux_room(tag, room):
    assert aux_room(tag) == room
