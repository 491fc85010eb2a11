"""Byte ranges of one state component's send (core/state_blocks.py); expected values by hand."""

import pytest

from sglang_disagg_ext.core.state_blocks import contiguous_runs, mamba_slot_block, paged_byte_blocks
from sglang_disagg_ext.core.state_plan import StateTransferError


def test_contiguous_runs_break_on_either_side():
    # (2,8) (3,9) step together; (5,10) breaks prefill; (6,4) breaks decode.
    assert contiguous_runs([2, 3, 5, 6], [8, 9, 10, 4]) == [(2, 8, 2), (5, 10, 1), (6, 4, 1)]
    assert contiguous_runs([], []) == []
    assert contiguous_runs([7], [0]) == [(7, 0, 1)]
    # Descending pages are not a run.
    assert contiguous_runs([3, 2], [5, 4]) == [(3, 5, 1), (2, 4, 1)]


def test_contiguous_runs_refuse_unaligned_lists():
    with pytest.raises(StateTransferError, match="differ in length"):
        contiguous_runs([1, 2], [3])


def test_paged_byte_blocks_scale_pages_by_item_len():
    assert paged_byte_blocks([2, 3, 5, 6], [8, 9, 10, 4], 128) == (
        [256, 640, 768],
        [1024, 1280, 512],
        [256, 128, 128],
    )
    assert paged_byte_blocks([], [], 128) == ([], [], [])


def test_mamba_whole_slot_with_equal_tp():
    assert mamba_slot_block(3, 6, 96, 96) == (288, 576, 96)
    assert mamba_slot_block(0, 7, 32) == (0, 224, 32)
    with pytest.raises(StateTransferError, match="slot size differs"):
        mamba_slot_block(3, 6, 96, 64)


def test_mamba_slice_prefill_tp_larger():
    # Prefill TP 2 holds 4 rows of 8 bytes per rank; decode TP 1 holds 8 rows.
    # Prefill rank 1 writes its 4 rows into rows 4..7 of the decode slot.
    assert mamba_slot_block(
        2, 5, 32, 64, src_dim=4, dst_dim=8, prefill_tp_size=2, decode_tp_size=1, prefill_tp_rank=1
    ) == (2 * 32, 5 * 64 + 4 * 8, 32)
    assert mamba_slot_block(
        2, 5, 32, 64, src_dim=4, dst_dim=8, prefill_tp_size=2, decode_tp_size=1, prefill_tp_rank=0
    ) == (64, 320, 32)


def test_mamba_slice_decode_tp_larger():
    # Prefill TP 1 holds 8 rows; decode rank 1 of TP 2 wants rows 4..7.
    assert mamba_slot_block(
        1, 3, 64, 32, src_dim=8, dst_dim=4, prefill_tp_size=1, decode_tp_size=2, decode_tp_rank=1
    ) == (64 + 4 * 8, 3 * 32, 32)


def test_mamba_tp_mismatch_without_dims():
    # Equal slot sizes: replicated state, whole slot.
    assert mamba_slot_block(1, 2, 48, 48, prefill_tp_size=2, decode_tp_size=1) == (48, 96, 48)
    # Different sizes and no dims: refused instead of copying a wrong-sized slot.
    with pytest.raises(StateTransferError, match="per-tensor dimension"):
        mamba_slot_block(1, 2, 32, 64, prefill_tp_size=2, decode_tp_size=1)


def test_mamba_refuses_inconsistent_geometry():
    with pytest.raises(StateTransferError, match="not multiples"):
        mamba_slot_block(0, 0, 30, 64, src_dim=4, dst_dim=8, prefill_tp_size=2, decode_tp_size=1)
    with pytest.raises(StateTransferError, match="rows differ"):
        mamba_slot_block(0, 0, 32, 32, src_dim=4, dst_dim=8, prefill_tp_size=2, decode_tp_size=1)
    with pytest.raises(StateTransferError, match="negative"):
        mamba_slot_block(-1, 0, 32, 32)
