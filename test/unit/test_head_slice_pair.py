"""F11's registration rule: which prefill/decode TP pairs can be head-sliced.

Expected messages written by hand: heads per rank are max(1, H // TP) (SGLang's
sharding), a buffer item is page_size x heads per rank x head bytes.
"""

import pytest

from sglang_disagg_ext.core.head_slice import HeadLayoutError, check_head_sliced_pair

PAGE = 4
HB = 16  # bytes of one head of one token (head_dim 8, bf16)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "p,d,h,per_p,per_d",
    [(2, 1, 2, 1, 2), (1, 2, 2, 2, 1), (1, 4, 2, 2, 1), (4, 1, 2, 1, 2), (2, 4, 8, 4, 2)],
)
def test_servable_pairs_pass(p, d, h, per_p, per_d):
    item = (PAGE * per_p * HB, PAGE * per_d * HB)
    layout = check_head_sliced_pair("KV", p, d, h, PAGE, [item, item])
    assert (layout.prefill_heads_per_rank, layout.decode_heads_per_rank) == (per_p, per_d)


@pytest.mark.timeout(10)
def test_three_heads_over_decode_tp2_is_refused_naming_everything():
    with pytest.raises(HeadLayoutError) as err:
        check_head_sliced_pair("KV", 1, 2, 3, PAGE, [(PAGE * 3 * HB, PAGE * 1 * HB)])
    assert str(err.value) == (
        "KV cannot be head-sliced from prefill TP 1 to decode TP 2 with 3 KV heads "
        "(3 per prefill rank, 1 per decode rank): decode TP size 2 does not divide the 3 KV heads (3 % 2 = 1)"
    )


@pytest.mark.timeout(10)
def test_state_buffer_with_other_head_size_is_refused_naming_the_buffer():
    # SWA pool with 1 head on every rank while the model has 2 KV heads: prefill TP 2
    # holds 1 head per rank (64 bytes a page = 16 per head), decode TP 1 should hold 2
    # but its page is 64 bytes: 8 bytes per head.
    with pytest.raises(HeadLayoutError) as err:
        check_head_sliced_pair("SWA state (component 0)", 2, 1, 2, PAGE, [(64, 64)])
    assert str(err.value) == (
        "SWA state (component 0) cannot be head-sliced from prefill TP 2 to decode TP 1 with 2 KV heads "
        "(1 per prefill rank, 2 per decode rank): buffer 0: one head is 16 bytes per token on prefill but 8 on decode"
    )


@pytest.mark.timeout(10)
def test_item_len_not_whole_heads_is_refused_naming_side_and_buffer():
    with pytest.raises(HeadLayoutError) as err:
        check_head_sliced_pair("KV", 1, 2, 2, PAGE, [(128, 64), (128, 66)])
    assert str(err.value) == (
        "KV cannot be head-sliced from prefill TP 1 to decode TP 2 with 2 KV heads "
        "(2 per prefill rank, 1 per decode rank): decode buffer 1: "
        "item_len 66 is not a multiple of page_size 4 x heads_per_rank 1"
    )


@pytest.mark.timeout(10)
def test_tp_sizes_that_do_not_divide_are_refused():
    with pytest.raises(HeadLayoutError, match=r"prefill TP 2 to decode TP 3 .*neither divides the other"):
        check_head_sliced_pair("KV", 2, 3, 6, PAGE, [])


def test_head_layout_for_names_the_caller_heads_and_both_tp_sizes():
    """3 KV heads cannot be split over decode TP 2: the error starts with the caller's context."""
    from sglang_disagg_ext.core.head_slice import head_layout_for

    with pytest.raises(HeadLayoutError) as err:
        head_layout_for(1, 2, 3, "nixl-ext: SWA state (component 0)")
    assert str(err.value).startswith(
        "nixl-ext: SWA state (component 0): 3 KV heads from prefill TP size 1 to decode TP size 2: "
    ), str(err.value)
    layout = head_layout_for(2, 1, 2, "nixl-ext")
    assert (layout.prefill_tp_size, layout.decode_tp_size, layout.total_kv_heads) == (2, 1, 2)
