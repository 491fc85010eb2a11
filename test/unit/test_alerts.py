"""The shipped alert rules (docs/alerts.yaml) and Grafana dashboard (docs/grafana-dashboard.json)
use only series the plugin exports, with labels those series have: a renamed metric cannot
leave an alert that never fires or a panel that stays empty."""

import json
import os
import re

import promql_parser
import pytest

from sglang_disagg_ext import metrics

yaml = pytest.importorskip("yaml", reason="PyYAML reads the rule file (SGLang's environments have it)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES = os.path.join(ROOT, "docs", "alerts.yaml")
DASHBOARD = os.path.join(ROOT, "docs", "grafana-dashboard.json")


def _exported():
    """Series name -> label names, as prometheus_client exposes each definition, with SGLang's
    scheduler labels every series carries on a server."""
    out = {}
    for name, (kind, _help, labels) in metrics.DEFINITIONS.items():
        full = metrics.PREFIX + name
        if kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[full + suffix] = set(labels) | set(metrics.SGLANG_LABELS) | ({"le"} if suffix == "_bucket" else set())
        else:
            out[full] = set(labels) | set(metrics.SGLANG_LABELS)
    return out


# Labels Prometheus adds at scrape time, not the plugin's.
SCRAPE_LABELS = {"instance", "job"}


def _check_expr(expr: str, where: str, exported) -> None:
    """``expr`` parses as PromQL (a Grafana ``label_values(...)`` query excepted: Grafana's, not
    PromQL), every series it names is exported, and every label it groups, selects or lists by
    is one of those series' labels."""
    if not expr.startswith("label_values("):
        try:
            promql_parser.parse(expr)
        except ValueError as exc:
            pytest.fail(f"{where}: not PromQL: {exc}\n{expr}")
    names = re.findall(r"sglang_disagg_ext_\w+", expr)
    assert names, where
    for name in names:
        assert name in exported, f"{where}: {name} is not exported"
    theirs = set().union(*(exported[n] for n in names))
    for by in re.findall(r"by \(([^)]*)\)", expr):
        labels = {x.strip() for x in by.split(",") if x.strip()} - SCRAPE_LABELS
        assert labels <= theirs, (where, labels - theirs)
    for sel in re.findall(r"\{([^}]*)\}", expr):
        for label in re.findall(r"(\w+)\s*=", sel):
            assert label in theirs, (where, label)
    for label in re.findall(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", expr):
        assert label in theirs, (where, label)


@pytest.mark.timeout(30)
def test_every_rule_names_an_exported_series_and_its_labels():
    with open(RULES, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert len(rules) >= 5 and all({"alert", "expr"} <= set(r) for r in rules)
    exported = _exported()
    for rule in rules:
        _check_expr(rule["expr"], rule["alert"], exported)


@pytest.mark.timeout(30)
def test_the_dashboard_queries_only_exported_series_and_labels():
    """docs/grafana-dashboard.json: every panel's queries and the model variable's query."""
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    exported = _exported()
    queries = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    queries += [(v["name"], v["query"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(dash["panels"]) >= 6 and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for where, expr in queries:
        _check_expr(expr, where, exported)
    # The headline figures an operator alerts on are on it: the failure ratio and the p99.
    exprs = " ".join(e for _, e in queries)
    assert 'sglang_disagg_ext_transfers_total{outcome="failed"' in exprs
    assert "histogram_quantile(0.99" in exprs and "sglang_disagg_ext_transfer_duration_seconds_bucket" in exprs
