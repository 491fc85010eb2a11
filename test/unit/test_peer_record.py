"""F18's compatibility record and verdict (core.peer_record), values written out by hand."""

import pytest

from sglang_disagg_ext.core import index_bounds, peer_record
from sglang_disagg_ext.core.peer_record import incompatibilities, record


def _rec(**kw):
    base = dict(plugin="0.3.0", sglang="0.5.23", page_size=4, kv_item_lens=[256, 256, 256, 256], kv_head_num=None,
                attn_tp_size=1)
    base.update(kw)
    return record(**base)


@pytest.mark.timeout(10)
def test_record_fields():
    assert _rec(kv_dtype="bfloat16") == {
        "wire": 1, "plugin": "0.3.0", "sglang": "0.5.23", "page_size": 4, "attn_tp_size": 1,
        "kv_item_lens": [256], "kv_dtype": "bfloat16",
    }
    # Values SGLang did not set are left out, not written as null.
    assert record(plugin="p", sglang="s", page_size=None, kv_item_lens=[], kv_head_num=0) == {
        "wire": 1, "plugin": "p", "sglang": "s"}


@pytest.mark.timeout(10)
def test_another_layout_mode_publishes_no_layout():
    # HiSparse / decode context parallel: page sizes legitimately differ; nothing compared.
    other = _rec(page_for_page=False, page_size=1, kv_item_lens=[64])
    assert other == {"wire": 1, "plugin": "0.3.0", "sglang": "0.5.23", "page_for_page": False}
    assert incompatibilities(_rec(), other) == [] and incompatibilities(other, _rec()) == []


@pytest.mark.timeout(10)
def test_same_layout_is_compatible_across_releases():
    assert incompatibilities(_rec(), _rec(sglang="0.5.11", plugin="0.2.9")) == []


@pytest.mark.timeout(10)
def test_page_bytes_compared_under_equal_tp():
    # Head dim 32 on decode: 4 tokens x 2 heads x 32 x 2 bytes = 512.
    assert incompatibilities(_rec(), _rec(kv_item_lens=[512] * 4)) == [
        "KV bytes per page of a layer buffer (attention TP 1 on both sides): prefill [256], decode [512]"]
    # Decode may hold more kinds (a draft model's layers appended), never fewer.
    assert incompatibilities(_rec(), _rec(kv_item_lens=[256, 256, 128])) == []
    assert incompatibilities(_rec(kv_item_lens=[256, 128]), _rec()) != []


@pytest.mark.timeout(10)
def test_other_tp_compares_bytes_per_head_where_known():
    # Prefill TP 1 holds 2 heads of 256/2 = 128 bytes; decode TP 2 one head of 128: compatible.
    ok = _rec(attn_tp_size=2, kv_item_lens=[128], kv_head_num=1)
    assert incompatibilities(_rec(kv_head_num=2), ok) == []
    bad = _rec(attn_tp_size=2, kv_item_lens=[256], kv_head_num=1)
    assert incompatibilities(_rec(kv_head_num=2), bad) == [
        "KV bytes per head per page (page size x head dim x dtype size): prefill [128], decode [256]"]
    # Decode's head count unknown (SGLang sets it on decode only for staging): nothing compared.
    assert incompatibilities(_rec(kv_head_num=2), _rec(attn_tp_size=2, kv_item_lens=[512])) == []


@pytest.mark.timeout(10)
def test_page_size_and_format():
    assert incompatibilities(_rec(), _rec(page_size=8, kv_item_lens=[512])) == [
        "page size (tokens): prefill 4, decode 8",
        "KV bytes per page of a layer buffer (attention TP 1 on both sides): prefill [256], decode [512]",
    ]
    other = dict(_rec(), wire=2)
    assert incompatibilities(_rec(), other) == ["handshake format: prefill 1, decode 2"]


@pytest.mark.timeout(10)
def test_refusal_names_both_sides():
    text = peer_record.refusal("127.0.0.1:1", _rec(), _rec(sglang="0.5.22"), ["page size (tokens): prefill 4, decode 8"])
    assert text == (
        "decode session 127.0.0.1:1 cannot be served: its KV cache layout differs from this prefill's (page size "
        "(tokens): prefill 4, decode 8): the two servers run different model configurations; decode runs SGLang "
        "0.5.22, sglang-disagg-ext 0.3.0, this prefill SGLang 0.5.23, sglang-disagg-ext 0.3.0")


@pytest.mark.timeout(10)
def test_record_travels_in_the_bounds_frame():
    rec = _rec()
    bounds = index_bounds.PoolBounds(kv=8, aux=8, peer=rec)
    back = index_bounds.decode_frame(index_bounds.encode_frame(bounds))
    assert back.peer == rec and back.kv == 8
    # A frame without it (an -ext decode before F18) or with something else there reads as no record.
    assert index_bounds.decode_frame(index_bounds.encode_frame(index_bounds.PoolBounds(kv=8, aux=8))).peer is None
    assert peer_record.parse({"wire": True}) is None and peer_record.parse("x") is None
