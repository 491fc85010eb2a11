"""Multi-rank expected values (harness/patterns.py), against hand-written tables.

Head placement is SGLang's QKV sharding: H >= TP: rank r holds heads
[r*H/TP, (r+1)*H/TP); H < TP: rank r holds head r // (TP/H).
"""

import numpy as np
import pytest

from sglang_disagg_ext.selftest.harness import patterns

RANK_HEADS = [
    # H, TP, {rank: heads}
    (4, 1, {0: [0, 1, 2, 3]}),
    (4, 2, {0: [0, 1], 1: [2, 3]}),
    (2, 2, {0: [0], 1: [1]}),
    (1, 2, {0: [0], 1: [0]}),
    (2, 4, {0: [0], 1: [0], 2: [1], 3: [1]}),
    (8, 4, {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}),
]


@pytest.mark.parametrize("h,tp,table", RANK_HEADS)
def test_rank_kv_heads(h, tp, table):
    assert {r: patterns.rank_kv_heads(h, tp, r) for r in range(tp)} == table
    assert patterns.heads_per_rank(h, tp) == len(table[0])


@pytest.mark.parametrize("h,tp", [(3, 2), (2, 3), (0, 1)])
def test_rank_kv_heads_refuses_unshardable(h, tp):
    with pytest.raises(ValueError):
        patterns.rank_kv_heads(h, tp, 0)


def test_all_heads_is_the_single_rank_pattern():
    full = patterns.kv_rank_buffer(3, 5, 4, 2, 16, [0, 1])
    assert np.array_equal(full, patterns.buffer_pattern(0, 3, 5, 4 * 2 * 16))


def test_a_rank_page_is_the_model_page_with_its_heads_kept():
    page_size, h, hb = 4, 4, 16
    model = patterns.page_bytes(0, 1, 7, page_size * h * hb).reshape(page_size, h, hb)
    rank = patterns.kv_rank_pages(1, [7], page_size, h, hb, [2, 3]).reshape(page_size, 2, hb)
    # token t, local head j of a rank holding heads 2, 3 is model head 2 + j
    for t in range(page_size):
        for j in range(2):
            assert np.array_equal(rank[t, j], model[t, 2 + j])


def test_replicas_hold_identical_bytes():
    a = patterns.kv_rank_buffer(0, 3, 4, 1, 16, patterns.rank_kv_heads(1, 2, 0))
    b = patterns.kv_rank_buffer(0, 3, 4, 1, 16, patterns.rank_kv_heads(1, 2, 1))
    assert np.array_equal(a, b)


def test_compare_names_the_wrong_element():
    page_size, h, hb, dtype_size = 4, 2, 16, 2
    heads = [1]
    exp = patterns.PoolExpectation(0, "kv", 6, writes={4: 2}, sentinel_pages=[0, 1, 2, 3, 5])
    actual = patterns.sentinel_buffer(6, page_size * len(heads) * hb)
    actual[4] = patterns.kv_rank_pages(3, [2], page_size, h, hb, heads)[0]
    assert patterns.compare_kv_rank_buffer(
        actual, 3, exp, num_layers=2, page_size=page_size, total_heads=h, head_bytes=hb, heads=heads,
        dtype_size=dtype_size, label="b3",
    ) == []
    actual[4, 2 * hb + 10] ^= 0xFF  # token 2, byte 10 of the head: dim 5
    actual[0, 0] = 0  # an untouched page written
    problems = patterns.compare_kv_rank_buffer(
        actual, 3, exp, num_layers=2, page_size=page_size, total_heads=h, head_bytes=hb, heads=heads,
        dtype_size=dtype_size, label="b3",
    )
    assert len(problems) == 2
    assert problems[0].startswith("b3 (V layer 1) page 4 token 2 head 1 dim 5: expected prefill page 2's element")
    assert problems[1] == "b3 (V layer 1) page 0: must be untouched, found written bytes"


# -- paged state pools over ranks (an SWA window cache is attention KV) -----------


@pytest.mark.timeout(30)
def test_a_state_rank_page_is_its_own_pools_model_page_with_its_heads_kept():
    page_size, h, hb, state_pool = 4, 2, 16, 2  # pool id 2: the first state pool
    model = patterns.page_bytes(state_pool, 0, 5, page_size * h * hb).reshape(page_size, h, hb)
    rank = patterns.kv_rank_pages(0, [5], page_size, h, hb, [1], pool_id=state_pool).reshape(page_size, 1, hb)
    for t in range(page_size):
        assert np.array_equal(rank[t, 0], model[t, 1])
    # The KV pool's page 5 of buffer 0 is other bytes: a state page landing in KV (or back) is caught.
    kv = patterns.kv_rank_pages(0, [5], page_size, h, hb, [1])
    assert not np.array_equal(kv[0], rank.reshape(-1))


@pytest.mark.timeout(30)
def test_compare_checks_a_state_pool_against_its_own_pattern():
    page_size, h, hb, state_pool = 4, 2, 16, 3
    exp = patterns.PoolExpectation(state_pool, "state1:swa", 4, writes={3: 1}, sentinel_pages=[0, 1, 2])
    actual = patterns.sentinel_buffer(4, page_size * hb)
    actual[3] = patterns.kv_rank_pages(0, [1], page_size, h, hb, [0], pool_id=state_pool)[0]
    kwargs = dict(num_layers=1, page_size=page_size, total_heads=h, head_bytes=hb, heads=[0], dtype_size=2, label="s")
    assert patterns.compare_kv_rank_buffer(actual, 0, exp, pool_id=state_pool, **kwargs) == []
    # The same bytes read as the KV pool's are wrong in every element of the page.
    problems = patterns.compare_kv_rank_buffer(actual, 0, exp, **kwargs)
    assert problems[0].startswith("s (K layer 0) page 3 token 0 head 0 dim 0: expected prefill page 1's element")


def _multi_rank(state_pools):
    from sglang_disagg_ext.selftest.harness.scenario import KVPoolSpec, RequestSpec, Scenario, StateSpec

    req = RequestSpec([1], [2], state=[StateSpec(p.kind, [1], [2]) for p in state_pools])
    return Scenario("ranks", [req], kv=KVPoolSpec(num_pages=4), state_pools=state_pools, prefill_tp=2)


@pytest.mark.timeout(30)
def test_multi_rank_scenarios_take_paged_state_pools_only():
    from sglang_disagg_ext.selftest.harness.scenario import ScenarioError, StatePoolSpec

    _multi_rank([StatePoolSpec("swa", num_pages=4)]).validate()
    with pytest.raises(ScenarioError, match="state pool 0 is 'mamba' with decode_extra_layers=0"):
        _multi_rank([StatePoolSpec("mamba", num_pages=4)]).validate()
    with pytest.raises(ScenarioError, match="state pool 0 is 'swa' with decode_extra_layers=1"):
        _multi_rank([StatePoolSpec("swa", num_pages=4, decode_extra_layers=1)]).validate()
