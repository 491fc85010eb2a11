"""F19's pure part (``core.prefill_answer``) and its reader in stock's lookup (``backends.common.prefill_answer``).

Expected values by hand: a 0.5.11 decode's ``PrefillServerInfo`` has 13 fields; 0.5.23's prefill
answers with four more in a plain setup (0.5.16 ``enable_dsa_cache_layer_split``,
``prefill_http_port``; 0.5.22 ``decode_allocation_policy``; 0.5.23 ``enable_kv_cache_sharding``).
The real two-release run is ``test/mixed/test_newer_prefill.py``.
"""

import dataclasses

import pytest

from sglang_disagg_ext.core.prefill_answer import refusal_reason, unknown_fields

DECODE_0_5_11_FIELDS = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
                        "follow_bootstrap_room", "target_tp_rank", "target_tp_ranks", "target_cp_ranks",
                        "target_pp_ranks", "required_dst_info_num", "required_prefill_response_num")
ANSWER_0_5_11 = {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 4,
                 "kv_cache_dtype": "auto", "follow_bootstrap_room": True, "target_tp_rank": None,
                 "target_tp_ranks": None, "target_cp_ranks": None, "target_pp_ranks": None,
                 "required_dst_info_num": None, "required_prefill_response_num": None}
ANSWER_0_5_23 = {**ANSWER_0_5_11, "enable_dsa_cache_layer_split": False, "decode_allocation_policy": "early",
                 "enable_kv_cache_sharding": False, "prefill_http_port": 30000}


@pytest.mark.timeout(10)
def test_an_answer_of_the_same_release_has_no_unknown_field():
    assert unknown_fields(ANSWER_0_5_11, DECODE_0_5_11_FIELDS) == {}


@pytest.mark.timeout(10)
def test_a_newer_answer_names_each_field_and_value_this_decode_lacks():
    unknown = unknown_fields(ANSWER_0_5_23, DECODE_0_5_11_FIELDS)
    assert unknown == {"enable_dsa_cache_layer_split": False, "decode_allocation_policy": "early",
                       "enable_kv_cache_sharding": False, "prefill_http_port": 30000}
    assert refusal_reason("10.0.0.1:8998", "0.5.11", unknown) == (
        "prefill 10.0.0.1:8998 runs a newer SGLang than this decode (SGLang 0.5.11): its bootstrap answer has "
        "fields this decode does not know (decode_allocation_policy='early', enable_dsa_cache_layer_split=False, "
        "enable_kv_cache_sharding=False, prefill_http_port=30000), and a decode older than its prefill cannot "
        "read its messages; upgrade decode before prefill")


@dataclasses.dataclass
class Info0511:
    """The shape of 0.5.11's ``PrefillServerInfo`` (its 13 fields), for the reader alone."""
    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int
    kv_cache_dtype: str
    follow_bootstrap_room: bool
    target_tp_rank: object = None
    target_tp_ranks: object = None
    target_cp_ranks: object = None
    target_pp_ranks: object = None
    required_dst_info_num: object = None
    required_prefill_response_num: object = None


@pytest.mark.timeout(10)
def test_the_reader_builds_a_known_answer_and_refuses_a_newer_one_past_a_catch_all():
    from sglang_disagg_ext.backends.common.prefill_answer import _AnswerReader, _RefusedAnswer

    reader = _AnswerReader(Info0511, "10.0.0.1:8998")
    assert reader(**ANSWER_0_5_11) == Info0511(**ANSWER_0_5_11)
    # Stock's lookup builds the info inside ``except Exception``: the refusal must pass through it.
    with pytest.raises(_RefusedAnswer, match="enable_kv_cache_sharding=False"):
        try:
            reader(**ANSWER_0_5_23)
        except Exception:  # noqa: BLE001 - what stock's lookup does
            pytest.fail("the refusal was caught by a catch-all")
