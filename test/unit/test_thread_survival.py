"""core.thread_survival: room of a message, root cause, reason text, prefill rank id."""

import pytest

from sglang_disagg_ext.core.thread_survival import (
    failure_reason,
    prefill_unique_rank,
    room_of_message,
    root_cause,
)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "frames, tags, room",
    [
        ([b"1000", b"127.0.0.1", b"17000", b"sess"], (), 1000),  # decode's pre-alloc message
        ([b"None", b"127.0.0.1"], (), None),  # registration: no room
        ([b"WATERMARK", b"3", b"7"], (), None),  # frame 1 is a round number, not a room
        ([b"AUX_DATA", b"42", b"0"], (b"AUX_DATA",), 42),
        ([b"AUX_DATA", b"x"], (b"AUX_DATA",), None),
        ([b"\xff\xfe"], (), None),
        ([], (), None),
        (None, (), None),
        ([b"-5", b"1"], (), -5),
    ],
)
def test_room_of_message(frames, tags, room):
    assert room_of_message(frames, tags) == room


@pytest.mark.timeout(10)
def test_root_cause_unwraps_reraise_chain():
    try:
        try:
            raise KeyError("inner")
        except KeyError as e:
            raise RuntimeError(f"Transfer thread failed because of {e}.")
    except RuntimeError as outer:
        wrapped = outer
    assert type(root_cause(wrapped)) is KeyError
    plain = ValueError("x")
    assert root_cause(plain) is plain


@pytest.mark.timeout(10)
def test_root_cause_stops_on_a_cycle():
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert root_cause(a) is b


@pytest.mark.timeout(10)
def test_failure_reason_names_thread_type_and_text():
    assert failure_reason("transfer worker", IndexError("list index out of range")) == (
        "transfer worker raised IndexError: list index out of range; the room is failed, the thread keeps serving"
    )


@pytest.mark.timeout(10)
def test_prefill_unique_rank():
    # tp 1, pp 1 of 2, cp 1 of 2: 1 * (2 * 2) + 1 * 2 + 1 = 7
    assert prefill_unique_rank(attn_tp_rank=1, pp_rank=1, pp_size=2, attn_cp_rank=1, attn_cp_size=2) == 7
    assert prefill_unique_rank(0, 0, 1, 0, 1) == 0
