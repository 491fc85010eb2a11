"""bench/e2e.py's figures recompute from their samples (values by hand)."""

import copy

import pytest

from bench import e2e


def _result():
    # ext/stock TTFT ratios 1.0, 1.1, 0.9 -> median 1.0, quartiles (inclusive) 0.95 and 1.05;
    # tokens/s ratios 1.0, 0.5, 2.0 -> median 1.0, quartiles 0.75 and 1.5.
    samples = {"ext": {"ttft_s": [0.2, 0.22, 0.18], "decode_tokens_per_s": [10.0, 5.0, 20.0]},
               "stock": {"ttft_s": [0.2, 0.2, 0.2], "decode_tokens_per_s": [10.0, 10.0, 10.0]}}
    return {"pairs": 3, "samples": samples,
            "ttft_ext_over_stock": {"median": 1.0, "q1": 0.95, "q3": 1.05, "verdict": "no verdict"},
            "decode_tokens_per_s_ext_over_stock": {"median": 1.0, "q1": 0.75, "q3": 1.5, "verdict": "no verdict"}}


@pytest.mark.timeout(10)
def test_figures_recompute_from_their_samples():
    e2e.check_e2e(_result())


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mutate,msg", [
    (lambda r: r["ttft_ext_over_stock"].update(median=0.99), "median"),
    (lambda r: r["decode_tokens_per_s_ext_over_stock"].update(verdict="met"), "verdict"),
    (lambda r: r["samples"]["ext"]["ttft_s"].pop(), "samples"),
])
def test_a_figure_not_from_its_samples_is_named(mutate, msg):
    r = copy.deepcopy(_result())
    mutate(r)
    with pytest.raises(ValueError, match=msg):
        e2e.check_e2e(r)


@pytest.mark.timeout(10)
def test_verdicts():
    assert e2e.verdict("ttft", {"q1": 0.9, "q3": 1.01}) == "met"
    assert e2e.verdict("ttft", {"q1": 1.03, "q3": 1.2}) == "not met"
    assert e2e.verdict("decode_tokens_per_s", {"q1": 0.97, "q3": 1.1}) == "no verdict"
