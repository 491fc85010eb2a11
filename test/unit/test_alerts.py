"""The shipped alert rules (docs/alerts.yaml) use only series the plugin exports, with labels
those series have: a renamed metric cannot leave an alert that never fires."""

import os
import re

import pytest

from sglang_disagg_ext import metrics

yaml = pytest.importorskip("yaml", reason="PyYAML reads the rule file (SGLang's environments have it)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES = os.path.join(ROOT, "docs", "alerts.yaml")


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


@pytest.mark.timeout(30)
def test_every_rule_names_an_exported_series_and_its_labels():
    with open(RULES, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert len(rules) >= 5 and all({"alert", "expr"} <= set(r) for r in rules)
    exported = _exported()
    # Labels Prometheus adds at scrape time, not the plugin's.
    scrape = {"instance", "job"}
    for rule in rules:
        names = re.findall(r"sglang_disagg_ext_\w+", rule["expr"])
        assert names, rule["alert"]
        for name in names:
            assert name in exported, f"{rule['alert']}: {name} is not exported"
        for by in re.findall(r"by \(([^)]*)\)", rule["expr"]):
            labels = {x.strip() for x in by.split(",")} - scrape
            assert labels <= set().union(*(exported[n] for n in names)), (rule["alert"], labels)
        for sel in re.findall(r"\{([^}]*)\}", rule["expr"]):
            for label in re.findall(r"(\w+)\s*=", sel):
                assert label in set().union(*(exported[n] for n in names)), (rule["alert"], label)
