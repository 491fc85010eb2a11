"""bench.results: the results.json schema, verdicts, table (pure)."""

import copy
import math

import pytest

from bench import results as res
from bench.stats import paired_ratios

GOOD = {
    "ext_over_stock": [{"case": "kv 1K tok x1", "ratio": 1.01}],
    "goodput_over_raw": [{"case": "swa 32 pages", "ratio": 0.95}],
    "slice_build_over_stock": [{"case": "P2->D4", "ratio": 0.8}],
    "offload_over_copy": [{"case": "128 pages", "ratio": 0.5}],
    "plugin_load_ms": 12.5,
    "ext_cpu_overhead": [{"case": "kv 8K tok x1", "added_cpu_us": 40.0, "transfer_us": 8000.0, "fraction": 0.005}],
    "fix_cpu_overhead": [{"case": "kv 8K tok x1", "fix": "F6", "added_cpu_us": 10.0, "stock_cpu_us": 30.0,
                          "transfer_us": 8000.0, "fraction": 0.00125}],
    "machine": {"cores": 2},
}


def _with_samples():
    """Results whose every figure comes from the samples listed under ``details`` (as bench.run writes them)."""
    stock = [0.010, 0.012, 0.011, 0.020, 0.009]
    ext = [0.011, 0.012, 0.010, 0.021, 0.010]
    p = paired_ratios(ext, stock)
    cpu = {"added_us": [30.0, 50.0, 40.0], "by_fix_us": {"F6": [10.0, 12.0, 11.0]},
           "stock_by_method_us": {"add_transfer_request": [20.0, 22.0, 21.0], "send_aux": [5.0, 5.0, 5.0]},
           "traced_labels": {"plugin": ["F6 RequestIsolationMixin.add_transfer_request"], "stock": []}}
    transfer = {"case": "kv 8K tok x1", "tokens": 8192, "concurrency": 1, "repeats": 5, "samples_s":
                {"stock": stock, "ext": ext}, "ratio": p["median"], "ratio_q1": p["q1"], "ratio_q3": p["q3"],
                "cpu": cpu}
    goodput = {"case": "swa 32 pages", "samples_s": {"ext": [2.0, 2.2], "raw": [1.9, 2.0]}}
    d = copy.deepcopy(GOOD)
    d["ext_over_stock"] = [{"case": transfer["case"], "ratio": p["median"]}]
    d["goodput_over_raw"] = [{"case": "swa 32 pages", "ratio": paired_ratios([1.9, 2.0], [2.0, 2.2])["median"]}]
    t_us = 0.009 * 1e6
    d["ext_cpu_overhead"] = [{"case": transfer["case"], "added_cpu_us": 40.0, "transfer_us": t_us,
                              "fraction": 40.0 / t_us}]
    d["fix_cpu_overhead"] = [{"case": transfer["case"], "fix": "F6", "added_cpu_us": 11.0, "stock_cpu_us": 21.0,
                              "transfer_us": t_us, "fraction": 11.0 / t_us}]
    d["details"] = {"transfer": [transfer], "goodput": [goodput]}
    return d


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
    (lambda d: d.pop("ext_cpu_overhead"), "lack key"),
    (lambda d: d.__setitem__("ext_cpu_overhead", []), "non-empty list"),
    (lambda d: d["ext_cpu_overhead"][0].pop("fraction"), "exactly the keys"),
    (lambda d: d["ext_cpu_overhead"][0].__setitem__("transfer_us", 0.0), "positive finite"),
    (lambda d: d["ext_cpu_overhead"][0].__setitem__("added_cpu_us", -1.0), "non-negative finite"),
    (lambda d: d["fix_cpu_overhead"][0].__setitem__("fix", ""), "non-empty string"),
    (lambda d: d.__setitem__("ext_over_stock", res.NA_UPSTREAM), "non-empty list"),  # item 1 is never n/a
])
def test_invalid_results_name_the_problem(mutate, msg):
    d = copy.deepcopy(GOOD)
    mutate(d)
    with pytest.raises(ValueError, match=msg):
        res.validate(d)


@pytest.mark.timeout(10)
def test_f4_f5_items_may_be_na_upstream():
    d = copy.deepcopy(GOOD)
    d["slice_build_over_stock"] = res.NA_UPSTREAM
    d["offload_over_copy"] = res.NA_UPSTREAM
    d["fix_cpu_overhead"] = []  # no fix row on a release without the fixes
    res.validate(d)


def _with_verified():
    """``_with_samples`` plus item 8 (verified/unverified end-to-end pairs)."""
    d = _with_samples()
    ext = [0.020, 0.021, 0.019]
    verified = [0.022, 0.022, 0.020]
    p = paired_ratios(verified, ext)
    # Hand: per pair 1.1, 22/21 = 1.0476..., 20/19 = 1.0526...: median 1.0526...
    assert math.isclose(p["median"], 20 / 19)
    read = [0.021, 0.0231, 0.0209]
    # Hand: read/ext per round 1.05, 1.1, 1.1: median 1.1, q1 1.075, q3 1.1 (linear between
    # order statistics); verified/read 22/21 = 1.0476..., 22/23.1 = 0.952..., 20/20.9 = 0.956...: median 0.956...
    d["details"]["verified"] = [{"case": "kv 8K tok x1", "repeats": 3,
                                 "samples_s": {"ext": ext, "verified": verified, "read": read},
                                 "ratio": p["median"], "ratio_q1": p["q1"], "ratio_q3": p["q3"],
                                 "read_ratio": 1.1, "read_ratio_q1": 1.075, "read_ratio_q3": 1.1,
                                 "verified_over_read": 20 / 20.9}]
    d[res.VERIFY_KEY] = [{"case": "kv 8K tok x1", "ratio": p["median"]}]
    return d


@pytest.mark.timeout(10)
def test_verified_item_is_optional_may_be_na_and_recomputes_from_its_samples():
    d = _with_verified()
    res.validate(d)
    res.check_samples(d)
    na = copy.deepcopy(GOOD)
    na[res.VERIFY_KEY] = "n/a: mooncake-ext passes through to stock on SGLang 0.5.11"
    res.validate(na)
    assert res.verdict(res.VERIFY_KEY, 1.2) == "no" and res.verdict(res.VERIFY_KEY, 1.05) == "yes"
    for mutate, msg in (
        (lambda d: d[res.VERIFY_KEY][0].__setitem__("ratio", 1.0), "verified_over_unverified kv 8K tok x1: ratio"),
        (lambda d: d["details"]["verified"][0]["samples_s"]["verified"].pop(), "samples listed"),
        (lambda d: d["details"]["verified"][0].__setitem__("case", "other"), "lists no samples"),
        (lambda d: d["details"]["verified"][0]["samples_s"]["read"].pop(), "read-floor samples listed"),
        (lambda d: d["details"]["verified"][0].__setitem__("read_ratio", 1.05), "read_ratio 1.05"),
        (lambda d: d["details"]["verified"][0].__setitem__("verified_over_read", 1.0), "verified_over_read"),
    ):
        bad = _with_verified()
        mutate(bad)
        with pytest.raises(ValueError, match=msg):
            res.check_samples(bad)
    bad = copy.deepcopy(GOOD)
    bad[res.VERIFY_KEY] = "not measured"
    with pytest.raises(ValueError, match="verified_over_unverified must be a non-empty list"):
        res.validate(bad)


@pytest.mark.timeout(10)
def test_every_figure_recomputes_from_its_samples():
    res.check_samples(_with_samples())


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d["ext_over_stock"][0].__setitem__("ratio", d["ext_over_stock"][0]["ratio"] * 1.01), "ratio"),
    (lambda d: d["details"]["transfer"][0].__setitem__("ratio_q3", 9.0), "q3"),
    (lambda d: d["details"]["transfer"][0]["samples_s"]["ext"].pop(), "samples listed"),
    (lambda d: d["details"]["transfer"][0].__setitem__("case", "other"), "lists no samples"),
    (lambda d: d["goodput_over_raw"][0].__setitem__("ratio", 1.0), "goodput_over_raw"),
    (lambda d: d["ext_cpu_overhead"][0].__setitem__("added_cpu_us", 39.0), "added_cpu_us"),
    (lambda d: d["ext_cpu_overhead"][0].__setitem__("transfer_us", 10000.0), "transfer_us"),
    (lambda d: d["ext_cpu_overhead"][0].__setitem__("fraction", 0.5), "fraction"),
    (lambda d: d["fix_cpu_overhead"][0].__setitem__("stock_cpu_us", 26.0), "stock_cpu_us"),
    (lambda d: d["fix_cpu_overhead"][0].__setitem__("fix", "F7"), "no CPU samples"),
])
def test_a_figure_not_from_its_samples_is_named(mutate, msg):
    d = _with_samples()
    mutate(d)
    with pytest.raises(ValueError, match=msg):
        res.check_samples(d)


@pytest.mark.timeout(10)
def test_fix_stock_cpu_sums_the_methods_the_fix_overrides():
    cpu = {"stock_by_method_us": {"add_transfer_request": [20.0, 30.0], "send_aux": [1.0, 3.0]},
           "traced_labels": {"plugin": ["F9 R.add_transfer_request", "F9 R.send_aux", "F6 I.add_transfer_request"]}}
    assert res.fix_methods(cpu, "F9") == ["add_transfer_request", "send_aux"]
    assert res.fix_stock_cpu(cpu, "F9") == 27.0  # median of 21, 33
    assert res.fix_stock_cpu(cpu, "F6") == 25.0
    assert res.fix_stock_cpu(cpu, "F7") == 0.0  # no frames of it


@pytest.mark.timeout(10)
@pytest.mark.parametrize("tokens,concurrency,fraction,expected", [
    (8192, 1, 0.02, "yes"), (8192, 1, 0.021, "no"), (1024, 1, 0.5, "-"), (8192, 4, 0.5, "-")])
def test_cpu_verdict_judged_at_8k_tokens(tokens, concurrency, fraction, expected):
    assert res.cpu_verdict(tokens, concurrency, fraction) == expected


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key,ratio,q1,q3,expected", [
    ("ext_over_stock", 1.02, None, None, "yes"),
    ("ext_over_stock", 1.10, 0.99, 1.20, "no verdict"),  # 1.02 inside [q1, q3]
    ("ext_over_stock", 1.00, 0.99, 1.20, "no verdict"),  # median meets it, but noise spans it
    ("ext_over_stock", 1.00, 0.95, 1.01, "yes"),
    ("ext_over_stock", 1.10, 1.05, 1.20, "no"),
    ("goodput_over_raw", 0.9, None, None, "yes"),
    ("goodput_over_raw", 0.8, 0.7, 0.95, "no verdict"),
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


@pytest.mark.timeout(30)
def test_committed_results_file_has_the_shape_and_every_figure_from_its_samples():
    """The ``bench/results.json`` in the repository (the README's table) is a whole run's output:
    every required key, and every ratio and CPU figure recomputes from the samples it lists."""
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results.json"
    data = json.loads(path.read_text())
    res.validate(data)
    res.check_samples(data)
    assert data["quick"] is False, "the committed results must come from a full `make bench`, not --quick"
