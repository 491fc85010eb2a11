"""Reading the plugin's series out of a process's Prometheus text (a harness worker's
``plugin_metrics``, a server's ``/metrics``), with prometheus_client's own parser.

Every series of the plugin also carries SGLang's scheduler labels (``model_name``, ``tp_rank``,
...; sglang_disagg_ext/metrics.py), so a test names only the labels it is about and gets the sum
over the samples that have them. Test-only; outside the wheel."""

from prometheus_client.parser import text_string_to_metric_families

# SGLang's scheduler labels the plugin copies onto its series, written out by hand from SGLang's
# scheduler metric labels (releases.sglang_metric_labels cites the lines).
SGLANG_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank")


def value(text: str, name: str, **labels) -> float:
    """Sum of sample ``name``'s values whose labels include ``labels`` (0.0 where never counted)."""
    want = {k: str(v) for k, v in labels.items()}
    return sum(s.value for family in text_string_to_metric_families(text or "") for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in want.items()))
