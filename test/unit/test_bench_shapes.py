"""bench.shapes: page lists and case plans (pure; hand-derived expectations)."""

import pytest

from bench import shapes
from bench.shapes import Plan, TransferCase, batch_pages, contiguous_runs, fragmented_pages, split_even


@pytest.mark.timeout(10)
def test_fragmented_pages_distinct_in_range_and_deterministic():
    pages = fragmented_pages(100, 129, seed=3)
    assert len(pages) == 100 == len(set(pages))
    assert min(pages) >= 1 and max(pages) <= 128  # page 0 is SGLang's padding page
    assert pages == fragmented_pages(100, 129, seed=3)


@pytest.mark.timeout(10)
def test_fragmented_pages_is_not_the_identity_order():
    # A whole 128-page pool in runs of 1..8 pages: shuffling leaves it far from 1, 2, ..., 128.
    pages = fragmented_pages(128, 129, seed=1)
    assert sorted(pages) == list(range(1, 129))
    assert contiguous_runs(pages, pages) >= 10


@pytest.mark.timeout(10)
def test_fragmented_pages_whole_pool_with_run_length_one_is_a_permutation():
    assert sorted(fragmented_pages(10, 11, seed=0, max_run=1)) == list(range(1, 11))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("count,pool", [(11, 11), (-1, 11)])
def test_fragmented_pages_refuses_impossible_counts(count, pool):
    with pytest.raises(ValueError, match="cannot hand out"):
        fragmented_pages(count, pool, seed=0)


@pytest.mark.timeout(10)
def test_split_even():
    assert split_even([1, 2, 3, 4, 5, 6], 3) == [[1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="equal parts"):
        split_even([1, 2, 3], 2)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("src,dst,runs", [
    ([], [], 0),
    ([1, 2, 3], [7, 8, 9], 1),
    ([1, 2, 3], [7, 9, 10], 2),  # decode breaks after the first page
    ([5, 1, 2], [1, 2, 3], 2),  # prefill breaks after the first page
    ([1, 3, 5], [2, 4, 6], 3),
])
def test_contiguous_runs(src, dst, runs):
    assert contiguous_runs(src, dst) == runs


@pytest.mark.timeout(10)
def test_state_component_pages():
    # 131072 tokens / 64 = 2048 pages; the SWA window of 2048 tokens is 32 pages.
    assert shapes.SWA.pages_for(131072) == 32
    assert shapes.NSA.pages_for(131072) == 2048
    assert shapes.SWA.pages_for(1000) == 16  # ceil(1000 / 64)
    # 2 (K, V) x 2 layers x 64 tokens x 1 head x 64 dims x 2 bytes
    assert shapes.SWA.page_bytes() == 32768
    assert shapes.kv_page_bytes() == 2 * 4 * 64 * 64 * 2


@pytest.mark.timeout(10)
def test_plan_cases_do_not_repeat_the_shared_point():
    plan = Plan(token_sweep=(1024, 2048), concurrency_sweep=(1, 4), concurrency_tokens=2048, repeats=1,
                goodput_pages=(8,), goodput_repeats=1)
    names = [c.name for c in plan.cases()]
    assert names == ["kv 1K tok x1", "kv 2K tok x1", "kv 2K tok x4",
                     "kv+state 1K tok x1", "kv+state 2K tok x1", "kv+state 2K tok x4"]


@pytest.mark.timeout(10)
def test_full_plan_pool_sizes():
    # KV: max(131072 / 64, 64 x 2048 / 64) = 2048 pages; SWA: 64 requests x 32 pages; NSA: 2048; +1 padding page.
    assert shapes.FULL.pool_pages() == {"kv": 2049, "swa": 2049, "nsa": 2049}


@pytest.mark.timeout(10)
def test_batch_pages_disjoint_across_requests():
    case = TransferCase(tokens=1024, concurrency=4, with_state=True)
    pool = {"kv": 65, "swa": 65, "nsa": 65}
    b = batch_pages(case, pool, (shapes.SWA, shapes.NSA))
    for key in ("src_kv", "dst_kv"):
        flat = sum(b[key], [])
        assert len(b[key]) == 4 and len(flat) == 64 == len(set(flat))
    for k in range(2):
        src = [req[k] for req in b["src_state"]]
        assert all(len(s) == 16 for s in src)
        assert len(set(sum(src, []))) == 64
    assert b["aux"] == [0, 1, 2, 3]


@pytest.mark.timeout(10)
def test_batch_pages_kv_only_has_no_state():
    b = batch_pages(TransferCase(1024, 2, False), {"kv": 65}, (shapes.SWA,))
    assert b["src_state"] == [[], []] and b["dst_state"] == [[], []]
