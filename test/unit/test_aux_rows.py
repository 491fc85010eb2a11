"""core.aux_rows: the decode's row-size frame and the one row check (F12)."""

import struct

import pytest

from sglang_disagg_ext.core.aux_rows import (
    AuxRowError,
    aux_row_blocks,
    aux_row_problem,
    decode_aux_item_lens,
    encode_aux_item_lens,
)


@pytest.mark.timeout(10)
def test_frame_layout_and_round_trip():
    frame = encode_aux_item_lens([64, 512, 8])
    assert frame == b"SDXA\x01" + struct.pack("<4I", 3, 64, 512, 8)
    assert decode_aux_item_lens(frame) == [64, 512, 8]
    assert decode_aux_item_lens(encode_aux_item_lens([])) == []


@pytest.mark.timeout(10)
def test_not_this_frame_is_none_malformed_raises():
    assert decode_aux_item_lens(b"") is None
    assert decode_aux_item_lens(b"\x00\x00\x00\x00") is None  # e.g. a later stock frame
    with pytest.raises(AuxRowError, match="shorter than its 9-byte header"):
        decode_aux_item_lens(b"SDXA\x01\x01")
    with pytest.raises(AuxRowError, match="version 2"):
        decode_aux_item_lens(b"SDXA\x02" + struct.pack("<I", 0))
    with pytest.raises(AuxRowError, match="says 2 buffers but holds 4 bytes"):
        decode_aux_item_lens(b"SDXA\x01" + struct.pack("<2I", 2, 64))
    with pytest.raises(AuxRowError):
        encode_aux_item_lens([-1])


@pytest.mark.timeout(10)
def test_row_problem_names_buffer_row_and_both_lengths():
    assert aux_row_problem(1, 5, 64, 64) is None
    assert aux_row_problem(1, 5, 60, 64) == "metadata (aux) buffer 1, row 5: 60 bytes sent, decode row is 64 bytes"
    assert aux_row_problem(1, 5, 28, 32, sender_len=64) == (
        "metadata (aux) buffer 1, row 5: prefill row 64 bytes, 28 bytes sent, decode row is 32 bytes"
    )
    assert aux_row_problem(0, 2, 12, 16, declared_len=16) == (
        "metadata (aux) buffer 0, row 2: the message declares 16 bytes but carries 12"
    )
    assert aux_row_problem(3, 0, 8, None) == "metadata (aux) buffer 3, row 0: the receiving side has no such buffer"
    assert aux_row_problem(0, 4, 8, 8, num_rows=4) == "metadata (aux) buffer 0, row 4: row outside the decode buffer's 4 rows"
    assert aux_row_problem(0, 3, 8, 8, num_rows=4) is None


@pytest.mark.timeout(10)
def test_aux_row_blocks_by_hand():
    # Two prefill buffers with 8- and 24-byte rows, three decode buffers: row 2 -> row 5 of
    # the first two only: 1000 + 8*2 -> 5000 + 8*5, and 2000 + 24*2 -> 6000 + 24*5.
    assert aux_row_blocks([1000, 2000], [8, 24], [5000, 6000, 7000], 2, 5) == [(1016, 5040, 8), (2048, 6120, 24)]
    assert aux_row_blocks([1000], [8], [], 0, 0) == []
