"""bench.stats: medians, interleaving order, paired ratios (pure; no timing asserted)."""

import math

import pytest

from bench.stats import interleaved_order, median, paired_ratios, ratio, run_interleaved


@pytest.mark.timeout(10)
def test_median_odd_and_even():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5  # (2 + 3) / 2


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad,msg", [([], "no samples"), ([1.0, math.nan], "non-finite"), ([math.inf], "non-finite")])
def test_median_refuses(bad, msg):
    with pytest.raises(ValueError, match=msg):
        median(bad)


@pytest.mark.timeout(10)
def test_interleaved_order_alternates_first():
    assert interleaved_order(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]


@pytest.mark.timeout(10)
def test_interleaved_order_balances_who_goes_first():
    order = interleaved_order(["stock", "ext"], 10)
    firsts = [order[2 * r][1] for r in range(10)]
    assert firsts.count("stock") == 5 and firsts.count("ext") == 5


@pytest.mark.timeout(10)
@pytest.mark.parametrize("names,repeats,msg", [(["a"], 0, "repeats"), (["a", "a"], 1, "distinct"), ([], 1, "distinct")])
def test_interleaved_order_refuses(names, repeats, msg):
    with pytest.raises(ValueError, match=msg):
        interleaved_order(names, repeats)


@pytest.mark.timeout(10)
def test_run_interleaved_calls_in_order_after_warmup():
    calls = []
    runs = {"x": lambda: calls.append("x") or 1.0, "y": lambda: calls.append("y") or 2.0}
    samples = run_interleaved(runs, repeats=3, warmup=1)
    assert calls == ["x", "y", "x", "y", "y", "x", "x", "y"]  # warm-up x y, then x y | y x | x y
    assert samples == {"x": [1.0, 1.0, 1.0], "y": [2.0, 2.0, 2.0]}


@pytest.mark.timeout(10)
def test_paired_ratios_pair_by_repeat():
    # pairs: 2/1 = 2, 3/3 = 1, 8/2 = 4, 5/5 = 1, 6/2 = 3 -> sorted 1 1 2 3 4
    r = paired_ratios([2, 3, 8, 5, 6], [1, 3, 2, 5, 2])
    assert r == {"median": 2.0, "q1": 1.0, "q3": 3.0}


@pytest.mark.timeout(10)
def test_paired_ratios_one_pair():
    assert paired_ratios([3.0], [2.0]) == {"median": 1.5, "q1": 1.5, "q3": 1.5}


@pytest.mark.timeout(10)
def test_paired_ratios_refuse_unequal_lengths():
    with pytest.raises(ValueError, match="equally many"):
        paired_ratios([1.0, 2.0], [1.0])


@pytest.mark.timeout(10)
@pytest.mark.parametrize("den", [0.0, -1.0, math.inf])
def test_ratio_refuses_bad_denominator(den):
    with pytest.raises(ValueError, match="denominator"):
        ratio(1.0, den)
