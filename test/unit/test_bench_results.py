"""bench.results: the results.json schema, verdicts, table (pure)."""

import copy
import math

import pytest

from bench import results as res

GOOD = {
    "ext_over_stock": [{"case": "kv 1K tok x1", "ratio": 1.01}],
    "goodput_over_raw": [{"case": "swa 32 pages", "ratio": 0.95}],
    "slice_build_over_stock": [{"case": "P2->D4", "ratio": 0.8}],
    "offload_over_copy": [{"case": "128 pages", "ratio": 0.5}],
    "plugin_load_ms": 12.5,
    "machine": {"cores": 2},
}


@pytest.mark.timeout(10)
def test_valid_results_pass():
    res.validate(copy.deepcopy(GOOD))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d.pop("plugin_load_ms"), "lack key"),
    (lambda d: d.__setitem__("goodput_over_raw", []), "non-empty list"),
    (lambda d: d["ext_over_stock"][0].__setitem__("ratio", 0.0), "positive finite"),
    (lambda d: d["ext_over_stock"][0].__setitem__("ratio", math.inf), "positive finite"),
    (lambda d: d["ext_over_stock"][0].__setitem__("ratio", True), "positive finite"),
    (lambda d: d["offload_over_copy"][0].__setitem__("extra", 1), "exactly the keys"),
    (lambda d: d["slice_build_over_stock"][0].__setitem__("case", ""), "non-empty string"),
    (lambda d: d.__setitem__("plugin_load_ms", math.nan), "plugin_load_ms"),
])
def test_invalid_results_name_the_problem(mutate, msg):
    d = copy.deepcopy(GOOD)
    mutate(d)
    with pytest.raises(ValueError, match=msg):
        res.validate(d)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key,ratio,q1,q3,expected", [
    ("ext_over_stock", 1.02, None, None, "yes"),
    ("ext_over_stock", 1.10, 0.99, 1.20, "noise"),  # 1.02 inside [q1, q3]
    ("ext_over_stock", 1.10, 1.05, 1.20, "no"),
    ("goodput_over_raw", 0.9, None, None, "yes"),
    ("goodput_over_raw", 0.8, 0.7, 0.95, "noise"),
    ("goodput_over_raw", 0.8, 0.7, 0.85, "no"),
    ("slice_build_over_stock", 1.0, None, None, "yes"),
    ("offload_over_copy", 0.1, None, None, "-"),
])
def test_verdict(key, ratio, q1, q3, expected):
    assert res.verdict(key, ratio, q1, q3) == expected


@pytest.mark.timeout(10)
def test_ratio_list_keeps_only_case_and_ratio():
    rows = [{"case": "a", "ratio": 1, "stock_s": 2.0}]
    assert res.ratio_list(rows) == [{"case": "a", "ratio": 1.0}]


@pytest.mark.timeout(10)
def test_format_table_aligns_columns():
    text = res.format_table([{"item": "1", "case": "long case name", "baseline": "1 ms", "ext": "2 ms",
                              "ratio": "2.0", "target": "<= 1.02", "met": "no"}])
    head, rule, row = text.splitlines()
    assert head.split() == ["item", "case", "stock/raw", "ext", "ratio", "target", "met?"]
    assert row.index("long case name") == head.index("case")
    assert [len(g) for g in rule.split("  ")] == [4, 14, 9, 4, 5, 7, 4]  # widest cell per column
